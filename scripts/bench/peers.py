"""Public implementations the kernels are compared with (scripts.bench.kernels), in PyTorch:

- tree attention: SDPA with a boolean mask (GQA native or with expanded K/V heads, whichever is
  faster) and flex_attention with a block mask built from the same ancestor bits (`TorchAttention`);
- GDN tree verify: one float32 state per node, each built from its parent's (what per-node-state
  implementations such as SGLang's / vLLM's keep, `TorchPerNode`), flash-linear-attention's fused
  recurrent kernel run on every root-to-leaf path (tree-correct, `FlaPaths`), and FLA on a plain chain
  of N tokens (a lower bound, not tree-correct: `fla_chain_fns`).

Each peer is built from the same inputs as our kernel and called with no arguments, so the caller
times it like its own kernel (common.time_torch). torch is imported when a peer is built (the
kernels' timings need no torch); FLA comes from the environment or from a carried wheel under .whl/
(the GPU machine has no network).
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import sys
import tempfile
import types
import zipfile

import jax.numpy as jnp
import numpy as np

from ddtree_jax.tree import bits_to_dense, root_path
from scripts.bench.common import err_str, time_torch


class TorchAttention:
    """SDPA and flex_attention over one jax argument set of tree attention."""

    def __init__(self):
        import torch

        self.torch = torch
        self.flex = None
        self.flex_error = None
        self.gqa_mode = None  # "enable_gqa" or "expanded", decided on first use

    def _tensors(self, a):
        """Torch views of one jax arg set: q [B, nh, N, hd], K/V [B, kv, Lmax + N, hd] with the tree
        K/V after the longest cache row (as if written into the cache), mask [B, 1, N, Lmax + N]."""
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
                fn = lambda tq=tq, k=k, v=v, m=mask, sc=scale: F.scaled_dot_product_attention(
                    tq, k, v, attn_mask=m, scale=sc)
            else:
                fn = lambda tq=tq, k=k, v=v, m=mask, sc=scale: F.scaled_dot_product_attention(
                    tq, k, v, attn_mask=m, scale=sc, enable_gqa=True)
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
        t_exp, _ = time_torch([lambda: F.scaled_dot_product_attention(tq, ke, ve, attn_mask=mask, scale=scale)],
                              rounds=3)
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
            fns.append(lambda tq=tq, k=k, v=v, bm=bm, sc=scale: self.flex(tq, k, v, block_mask=bm, scale=sc,
                                                                           enable_gqa=True))
        return fns

    def check(self, fn, ref):
        """Relative error of a peer's output [B, nh, N, hd] against ours [B, N, nh, hd]."""
        out = fn().transpose(1, 2).float().cpu().numpy()
        ref = np.asarray(ref, np.float32)
        return float(np.abs(out - ref).max() / np.abs(ref).max())


def import_fla():
    """FLA's gated delta rule ops: from the environment, else from a carried wheel under .whl/
    (unpacked to a temp dir). When fla/__init__ needs packages that are missing (its layers and
    models import transformers / einops), the ops are loaded under a stub `fla` package."""

    def ops():
        return importlib.import_module("fla.ops.gated_delta_rule")

    if importlib.util.find_spec("einops") is None:  # fla imports it at module level (naive refs)
        stub = types.ModuleType("einops")

        def missing(*_a, **_k):
            raise NotImplementedError("einops is not installed (stubbed for importing fla)")

        stub.rearrange = stub.repeat = stub.reduce = stub.einsum = missing
        sys.modules["einops"] = stub

    try:
        return ops(), "installed"
    except Exception as first:
        reason = err_str(first)
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        del sys.modules[name]
    roots = []
    spec = importlib.util.find_spec("fla")
    if spec and spec.submodule_search_locations:
        roots.append(("installed (stub package)", list(spec.submodule_search_locations)[0]))
    wheels = sorted(glob.glob(".whl/flash_linear_attention*.whl") + glob.glob(".whl/fla*.whl"))
    if wheels:
        dest = tempfile.mkdtemp(prefix="fla_")
        with zipfile.ZipFile(wheels[0]) as z:
            z.extractall(dest)
        sys.path.insert(0, dest)
        try:
            return ops(), f"from {wheels[0]}"
        except Exception as e:
            reason += f"; wheel: {err_str(e)}"
            for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
                del sys.modules[name]
            roots.append((f"from {wheels[0]} (stub package)", os.path.join(dest, "fla")))
    for how, root in roots:
        stub = types.ModuleType("fla")
        stub.__path__ = [root]
        stub.__version__ = "?"
        sys.modules["fla"] = stub
        try:
            return ops(), how
        except Exception as e:
            reason += f"; {how}: {err_str(e)}"
            for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
                del sys.modules[name]
    return None, reason if (roots or wheels) else f"not importable ({reason}); no .whl/flash_linear_attention*.whl"


class TorchPerNode:
    """One fp32 state per node, S_i = step(S_parent(i)), built level by level (the peers' per-node
    state buffers); o_i = S_i^T q_i. Different trees per sequence: nodes are flattened (b, i)."""

    def __init__(self, pb, dtype, device):
        import torch

        self.torch = torch
        b, hk, n, dk = pb["q"].shape
        hv, dv = pb["v"].shape[1], pb["v"].shape[3]
        rep = hv // hk
        tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
        t = lambda x, dt=torch.float32: torch.tensor(x, device=device).to(dt)
        flat = lambda x: x.transpose(1, 2).reshape(b * n, *x.shape[1:2], *x.shape[3:])  # [B*N, H, ...]
        q = t(pb["q"], tdt).repeat_interleave(rep, dim=1)
        k = t(pb["k"], tdt).repeat_interleave(rep, dim=1)
        self.q, self.k, self.v = flat(q), flat(k), flat(t(pb["v"], tdt))
        self.g = t(pb["g"]).transpose(1, 2).reshape(b * n, hv)
        self.beta = t(pb["beta"]).transpose(1, 2).reshape(b * n, hv)
        self.state0 = t(pb["state"])
        self.shape = (b, n, hv, dk, dv)
        # states buffer: B*N node states + the B committed states at the end (roots' parents)
        self.S = torch.empty(b * n + b, hv, dk, dv, device=device, dtype=torch.float32)
        self.o = torch.empty(b * n, hv, dv, device=device, dtype=torch.float32)
        levels = {}
        for bi, tree in enumerate(pb["trees"]):
            for i, p in enumerate(tree):
                d = len(root_path(tree, i)) - 1
                parent = b * n + bi if p < 0 else bi * n + p
                levels.setdefault(d, []).append((bi * n + i, parent))
        self.levels = [
            (torch.tensor([x for x, _ in levels[d]], device=device),
             torch.tensor([p for _, p in levels[d]], device=device))
            for d in sorted(levels)
        ]
        self.state_bytes = b * n * hv * dk * dv * 4

    def __call__(self):
        torch, f32 = self.torch, self.torch.float32
        b, n = self.shape[:2]
        self.S[b * n :].copy_(self.state0)
        for idx, par in self.levels:
            s = self.S[par] * torch.exp(self.g[idx])[..., None, None]
            k = self.k[idx].to(f32)
            u = self.beta[idx][..., None] * (self.v[idx].to(f32) - torch.einsum("lhkv,lhk->lhv", s, k))
            s = s + k[..., :, None] * u[..., None, :]
            self.S[idx] = s
            self.o[idx] = torch.einsum("lhkv,lhk->lhv", s, self.q[idx].to(f32))
        return self.o

    def output_bhnv(self):
        b, n, hv, dk, dv = self.shape
        return self.o.reshape(b, n, hv, dv).permute(0, 2, 1, 3).cpu().numpy()


class FlaPaths:
    """FLA fused recurrent over every root-to-leaf path (tree-correct; inputs gathered once,
    outside the timing; each path starts from its sequence's committed state)."""

    def __init__(self, fla_ops, pb, device):
        import torch

        self.torch, self.ops = torch, fla_ops
        b, hk, n, dk = pb["q"].shape
        hv = pb["v"].shape[1]
        rep = hv // hk
        paths, owners = [], []
        for bi, tree in enumerate(pb["trees"]):
            has_child = set(p for p in tree if p >= 0)
            for leaf in (i for i in range(n) if i not in has_child):
                paths.append(root_path(tree, leaf))
                owners.append(bi)
        t_len = max(len(p) for p in paths)
        s_n = len(paths)
        idx = np.zeros((s_n, t_len), np.int64)
        on = np.zeros((s_n, t_len), bool)
        for s, p in enumerate(paths):
            idx[s, : len(p)] = p
            on[s, : len(p)] = True
        owner = np.array(owners)
        bt = lambda x: torch.tensor(x, device=device)
        owner_t, idx_t, on_t = bt(owner), bt(idx), bt(on)

        def gather(x):  # [B, H, N, ...] -> [S, T, H, ...], on device (numpy indexing rules)
            g = bt(x)[owner_t[:, None], :, idx_t]
            return g * on_t.reshape(on_t.shape + (1,) * (g.ndim - 2))

        heads = lambda x: np.repeat(x, rep, axis=1)
        self.q = gather(heads(pb["q"])).to(torch.bfloat16)
        self.k = gather(heads(pb["k"])).to(torch.bfloat16)
        self.v = gather(pb["v"]).to(torch.bfloat16)
        self.g = gather(pb["g"]).float()
        self.beta = gather(pb["beta"]).float()
        self.h0 = bt(pb["state"])[owner_t].float()
        self.paths, self.owner, self.idx, self.on = paths, owner, idx, on
        self.shape = (b, hv, n, pb["v"].shape[3])
        self.n_paths, self.t_len = s_n, t_len

    def __call__(self):
        o, _ = self.ops.fused_recurrent_gated_delta_rule(
            q=self.q, k=self.k, v=self.v, g=self.g, beta=self.beta, scale=1.0,
            initial_state=self.h0, output_final_state=False,
        )
        self.o = o
        return o

    def output_bhnv(self):
        o = self.o.float().cpu().numpy()  # [S, T, H, dv]
        out = np.full(self.shape, np.nan, np.float32)
        for s, p in enumerate(self.paths):
            for t, node in enumerate(p):
                out[self.owner[s], :, node] = o[s, t]
        return out


def fla_chain_fns(fla_ops, pb, device):
    """FLA's fused recurrent and chunked kernels on a chain of N tokens per sequence (NOT
    tree-correct: a lower bound on what a chain kernel costs for N tokens)."""
    import torch

    b, hk, n, dk = pb["q"].shape
    rep = pb["v"].shape[1] // hk
    bt = lambda x: torch.tensor(x, device=device)
    seq = lambda x: bt(np.swapaxes(x, 1, 2))  # [B, H, N, ...] -> [B, N, H, ...]
    q = seq(np.repeat(pb["q"], rep, axis=1)).to(torch.bfloat16)
    k = seq(np.repeat(pb["k"], rep, axis=1)).to(torch.bfloat16)
    v = seq(pb["v"]).to(torch.bfloat16)
    g, beta = seq(pb["g"]).float(), seq(pb["beta"]).float()
    h0 = bt(pb["state"]).float()
    kw = dict(q=q, k=k, v=v, g=g, beta=beta, scale=1.0, initial_state=h0, output_final_state=True)
    return {
        "fla_chain_recurrent": lambda: fla_ops.fused_recurrent_gated_delta_rule(**kw),
        "fla_chain_chunk": lambda: fla_ops.chunk_gated_delta_rule(**kw),
    }
