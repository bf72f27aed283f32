"""PyTorch peers of the tree-attention kernel for scripts/gpu_tree_attention.py: SDPA with a boolean
mask (GQA native or with expanded K/V heads, whichever is faster) and flex_attention with a block
mask built from the same ancestor bits. Each returns zero-argument callables over one jax
argument set, so the caller times them like its own kernel."""

from __future__ import annotations

import numpy as np

from gpu_bench_common import time_torch as _time_torch


def time_torch(fns, *, round_s=0.005, rounds=7):
    return _time_torch(fns, round_s=round_s, rounds=rounds, max_iters=200)


class TorchPeers:
    def __init__(self):
        import torch

        self.torch = torch
        self.flex = None
        self.flex_error = None
        self.gqa_mode = None  # "enable_gqa" or "expanded", decided on first use

    def _tensors(self, a):
        """Torch views of one jax arg set: q [B, nh, N, hd], K/V [B, kv, Lmax + N, hd] with the tree
        K/V after the longest cache row (as if written into the cache), mask [B, 1, N, Lmax + N]."""
        import jax.numpy as jnp

        from ddtree_jax.tree import bits_to_dense

        torch = self.torch
        q, kc, vc, lens, kt, vt, bits = a
        b, n = q.shape[:2]
        lmax = int(np.max(np.asarray(lens)))
        td = lambda x: torch.from_dlpack(x)
        tq = td(q).transpose(1, 2).contiguous()
        k = torch.cat([td(kc)[:, :, :lmax], td(kt).transpose(1, 2)], dim=2).contiguous()
        v = torch.cat([td(vc)[:, :, :lmax], td(vt).transpose(1, 2)], dim=2).contiguous()
        vis = td(jnp.asarray(bits_to_dense(bits, n)))
        lens_t = td(lens).to(torch.int64)
        pos = torch.arange(lmax, device=k.device)
        cache_mask = (pos[None, None, :] < lens_t[:, None, None]).expand(b, n, lmax)
        mask = torch.cat([cache_mask, vis], dim=2)[:, None]  # [B, 1, N, Lmax + N]
        return tq, k, v, mask, lens_t, vis, lmax

    def sdpa_fns(self, arg_sets, decode=False):
        torch = self.torch
        F = torch.nn.functional
        fns = []
        for a in arg_sets:
            tq, k, v, mask, lens_t, vis, lmax = self._tensors(a)
            scale = tq.shape[-1] ** -0.5
            if decode and tq.shape[0] == 1:
                k, v, mask = k[:, :, :lmax].contiguous(), v[:, :, :lmax].contiguous(), None  # plain decode
            elif decode:
                k, v, mask = k[:, :, :lmax].contiguous(), v[:, :, :lmax].contiguous(), mask[..., :lmax].contiguous()
            group = tq.shape[1] // k.shape[1]
            if self.gqa_mode is None:
                self.gqa_mode = self._pick_gqa(tq, k, v, mask, scale, group)
            if self.gqa_mode == "expanded":
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                fn = lambda tq=tq, k=k, v=v, m=mask: F.scaled_dot_product_attention(tq, k, v, attn_mask=m, scale=scale)
            else:
                fn = lambda tq=tq, k=k, v=v, m=mask: F.scaled_dot_product_attention(
                    tq, k, v, attn_mask=m, scale=scale, enable_gqa=True)
            fns.append(fn)
        return fns

    def _pick_gqa(self, tq, k, v, mask, scale, group):
        """enable_gqa=True if it runs and is not slower than pre-expanded K/V heads."""
        torch = self.torch
        F = torch.nn.functional
        try:
            t_gqa, _ = time_torch([lambda: F.scaled_dot_product_attention(tq, k, v, attn_mask=mask, scale=scale,
                                                                          enable_gqa=True)], rounds=3)
        except Exception:
            return "expanded"
        ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        t_exp, _ = time_torch([lambda: F.scaled_dot_product_attention(tq, ke, ve, attn_mask=mask, scale=scale)], rounds=3)
        return "enable_gqa" if t_gqa <= t_exp else "expanded"

    def flex_fns(self, arg_sets):
        torch = self.torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if self.flex is None:
            self.flex = torch.compile(flex_attention)
        fns = []
        for a in arg_sets:
            tq, k, v, mask, lens_t, vis, lmax = self._tensors(a)
            b, _, n, _ = tq.shape

            def mask_mod(bb, h, qi, kv, lens_t=lens_t, vis=vis, lmax=lmax):
                t = kv - lmax
                in_tree = (t >= 0) & vis[bb, qi, t.clamp(min=0)]
                return (kv < lens_t[bb]) | in_tree

            bm = create_block_mask(mask_mod, b, None, n, lmax + n, device=tq.device)
            scale = tq.shape[-1] ** -0.5
            fns.append(lambda tq=tq, k=k, v=v, bm=bm: self.flex(tq, k, v, block_mask=bm, scale=scale, enable_gqa=True))
        return fns

    def check(self, fn, ref):
        """Relative error of a peer's output [B, nh, N, hd] against ours [B, N, nh, hd]."""
        out = fn().transpose(1, 2).float().cpu().numpy()
        ref = np.asarray(ref, np.float32)
        return float(np.abs(out - ref).max() / np.abs(ref).max())
