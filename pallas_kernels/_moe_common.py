"""What every form of the routed-expert product shares (pallas_kernels/moe_experts.py is the entry
point; its docstring states the contract and the rounding): the constants and tilings (GemmConfig,
MoeConfig, DecodeConfig), the operand and kernel checks, the rounding and the activation as the XLA
forms spell them, the weighted sum over the k choices, and the two XLA references the kernels are
tested against (`reference`, the gathered form; `dense_reference`, every expert on every token).
A module of its own so that the grouped path (_moe_grouped.py) and the decode path
(_moe_decode.py) share one copy and neither imports the other.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._common import dot_precision, is_pow2, rounded
from pallas_kernels.softmax_top_k import SOFTMAX_TOP_K_MAX_K, SOFTMAX_TOP_K_MAX_LEN, softmax_top_k

ACTS = ("silu_glu", "relu2")
W_LAYOUTS = ("in_out", "out_in")  # [E, in, out] (the project's Linear layout) or [E, out, in] (HF's)
GEMM_LAYOUTS = ("cols", "rows")
# The decode path also takes "fma": no MMA, the weight tile times the row broadcast over it,
# accumulated in float32 and summed over K once at the end (a GEMV on the CUDA cores).
DECODE_LAYOUTS = (*GEMM_LAYOUTS, "fma")
DTYPES = ("bfloat16", "float16", "float32")
MIN_BLOCK = 16  # Triton's tl.dot needs every block dimension >= 16
TARGET_PROGRAMS = 256  # ~two programs per SM of the H200's 132, all resident at once: loads in flight
COMBINES = ("kernel", "xla", "fused")
GROUPINGS = ("xla", "kernel")  # MoeConfig.grouping


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tiling of one of the kernel's two launches. block_n / block_k are upper bounds: a launch
    uses the largest power of two <= them that divides its N / K (`fit`). split_k > 1 splits K
    into that many slices (a power of two dividing K / block_k) whose float32 partial products
    XLA adds (then rounds, and for the first launch applies the activation). layout "cols" puts
    the weight columns on the MMA's M side (w^T x^T: the few rows of a tile are its N side),
    "rows" is the plain x @ w; "fma" (decode path only) no MMA at all (DECODE_LAYOUTS)."""

    block_n: int = 64
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    layout: str = "cols"
    # the decode path's launch (1) only: its MMA row operand as one masked [MIN_BLOCK, block_k] load,
    # which Triton pipelines with the weights' tiles, instead of the loaded row padded by a select
    # (register loads waited on every K step: decision 0063; faster on the H200 and the decode
    # path's default: 0064, which also found launch (2)'s activation row no better masked)
    masked_row: bool = False

    def problems(self, name: str, layouts: tuple[str, ...] = GEMM_LAYOUTS) -> list[str]:
        bad = [f"{name}.{f} = {getattr(self, f)} (a power of two >= {MIN_BLOCK})" for f in ("block_n", "block_k")
               if not (is_pow2(getattr(self, f)) and getattr(self, f) >= MIN_BLOCK)]
        bad += [] if is_pow2(self.split_k) else [f"{name}.split_k = {self.split_k} (a power of two)"]
        bad += [] if self.layout in layouts else [f"{name}.layout = {self.layout!r} (one of {layouts})"]
        bad += [] if self.num_warps in (1, 2, 4, 8, 16) else [f"{name}.num_warps = {self.num_warps}"]
        bad += [] if self.num_stages >= 1 else [f"{name}.num_stages = {self.num_stages}"]
        bad += [f"{name}.masked_row with layout 'fma' (an MMA layout's operand)"] if (
            self.masked_row and self.layout == "fma") else []
        return bad

    def fit(self, n: int, k: int) -> GemmConfig:
        """The blocks and split this launch uses for an [., k] x [k, n] product (n, k multiples of 16)."""
        bn, bk = _fit_block(self.block_n, n), _fit_block(self.block_k, k)
        split = self.split_k
        while split > 1 and k % (split * bk):
            split //= 2
        return dataclasses.replace(self, block_n=bn, block_k=bk, split_k=split)


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """The kernel's tiling: block_m rows per tile (a power of two >= 16); `up` the first launch
    (x @ w_in, activation), `down` the second (h @ w_out); `grouping`: the pairs grouped by XLA's
    fusions ("xla": `group_pairs`) or by one kernel launch ("kernel": pallas_kernels/pair_groups.py)."""

    block_m: int = 16
    up: GemmConfig = GemmConfig()
    down: GemmConfig = GemmConfig()
    grouping: str = "xla"

    def problems(self) -> list[str]:
        bad = [] if is_pow2(self.block_m) and self.block_m >= MIN_BLOCK else [
            f"block_m = {self.block_m} (a power of two >= {MIN_BLOCK})"]
        bad += [] if self.grouping in GROUPINGS else [f"grouping = {self.grouping!r} (one of {GROUPINGS})"]
        bad += [f"{n}.masked_row (the decode path's launch (1) only)" for n, c in (("up", self.up), ("down", self.down))
                if c.masked_row]
        return bad + self.up.problems("up") + self.down.problems("down")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """The decode path's tiling (no grouping; pallas_kernels/_moe_decode.py). `up`: launch (1) over (column
    block, K slice, pair); its split_k > 1 writes float32 partials that launch (2) adds, rounds and
    activates as it loads them. `down`: launch (2). combine "kernel": one program per (column
    block, token) runs the token's k choices and writes y (down.split_k must be 1); "xla": one
    program per (column block, K slice, pair) writes the pair's rounded output (or float32
    partials), which XLA adds up, weights and sums over k (one more fusion); "fused": one launch
    (pallas_kernels/_moe_fused.py): up.block_n is the chunk of intermediate columns a program owns
    (its gate / up over all of K, then the chunk's share of the down product), up.block_k its K
    step, down.block_n the output columns of a down step (down.block_k unused). Each GemmConfig's
    layout names the product's form: the MMA on the padded row ("cols": weight columns on the MMA's
    M side; "rows") or "fma" (the row broadcast over the weight tile, no MMA)."""

    up: GemmConfig = GemmConfig(block_n=64, block_k=64, split_k=4)
    down: GemmConfig = GemmConfig(block_n=64, block_k=64)
    combine: str = "kernel"

    def problems(self) -> list[str]:
        bad = self.up.problems("up", DECODE_LAYOUTS) + self.down.problems("down", DECODE_LAYOUTS)
        if self.down.masked_row:
            bad.append("down.masked_row (launch (1) only: launch (2)'s activation row masked was slower, 0064)")
        if self.up.masked_row and self.combine == "fused":
            bad.append("up.masked_row with combine 'fused' (the two launches' form only)")
        if self.combine not in COMBINES:
            bad.append(f"combine = {self.combine!r} (one of {COMBINES})")
        elif self.combine == "kernel" and self.down.split_k != 1:
            bad.append(f"down.split_k = {self.down.split_k} with combine 'kernel' (its program sums whole rows: 1)")
        elif self.combine == "fused" and (self.up.split_k != 1 or self.down.split_k != 1):
            bad.append(f"split_k = {self.up.split_k} / {self.down.split_k} with combine 'fused' (a program owns its "
                       "chunk's whole K: 1)")
        return bad


def _fit_block(block: int, dim: int) -> int:
    """The largest power of two <= block dividing dim."""
    return min(block, dim & -dim)


def _filling_split(programs: int, k: int, bk: int) -> int:
    """The power-of-two K split that brings a launch of `programs` programs to TARGET_PROGRAMS
    (each slice at least 4 K blocks deep, dividing K)."""
    split = 1
    while programs * split < TARGET_PROGRAMS and k % (2 * split * bk) == 0 and k // (2 * split) >= 4 * bk:
        split *= 2
    return split


# ----------------------------------------------------------------------------------------------
# operand checks


def _dims(w_in, w_out, w_layout: str):
    """(E, H, N1, I, H_out) of the expert weights as stored."""
    if w_layout == "in_out":
        e, h, n1 = w_in.shape
        _, i, h2 = w_out.shape
    else:
        e, n1, h = w_in.shape
        _, h2, i = w_out.shape
    return e, h, n1, i, h2


class Shared(NamedTuple):
    """A shared expert added to every token as one more weighted choice (Qwen-MoE's shared expert
    scaled by its sigmoid gate): w_in [1, ...] and w_out [1, ...], one expert stored like the routed
    ones (same layout and sizes), and its combine weight per token: weight [T] float32, or the
    gate's weight gate_w [H] (x's dtype; HF's shared_expert_gate, a Linear H -> 1), which makes it
    round(sigmoid(round(x @ gate_w))) (`gate_weight`; the decode path computes the product in its
    first launch). The forms that take it (`reference`, the decode path) sum it with the routed
    choices in float32 and round once: y[t] = round(sum_j w[t, j] o_j + weight[t] o_shared)."""

    w_in: jax.Array
    w_out: jax.Array
    weight: jax.Array | None = None
    gate_w: jax.Array | None = None


class Choice(NamedTuple):
    """A softmax router's logits, from which the decode path's first launch chooses each token's
    experts itself (pallas_kernels/softmax_top_k.py's arithmetic: softmax in float32, the top_k
    largest, lower index on ties, renormalised if norm, weights rounded to weights_dtype), instead
    of a launch of its own before it: logits [T, E] (the router's dtype, taken as float32), or with
    logits_dtype float32 split-K partial sums [S, T, E] (added in index order, rounded to it)."""

    logits: jax.Array
    top_k: int
    norm: bool
    weights_dtype: Any = jnp.float32
    logits_dtype: Any = None

    def problems(self) -> list[str]:
        lg, bad = self.logits, []
        if lg.ndim != (3 if self.logits_dtype is not None else 2):
            bad.append(f"router logits {tuple(lg.shape)}: [T, E], or float32 partial sums [S, T, E] with logits_dtype")
        elif self.logits_dtype is not None and lg.dtype != jnp.float32:
            bad.append(f"router partial sums must be float32, got {lg.dtype}")
        if lg.shape[-1] > SOFTMAX_TOP_K_MAX_LEN or not 1 <= self.top_k <= min(lg.shape[-1], SOFTMAX_TOP_K_MAX_K):
            bad.append(f"top-{self.top_k} of {lg.shape[-1]} experts (the choice takes up to {SOFTMAX_TOP_K_MAX_LEN} "
                       f"experts, k up to {SOFTMAX_TOP_K_MAX_K})")
        return bad

    def reference(self):
        """(ids [T, k] int32, weights [T, k] float32): softmax_top_k's XLA form of the same choice."""
        return softmax_top_k(self.logits, self.top_k, norm=self.norm, weights_dtype=self.weights_dtype,
                             logits_dtype=self.logits_dtype)


def gate_weight(g, dtype, cast: bool = False):
    """The shared expert's combine weight from its gate product g (float32 sums, not yet rounded):
    round(sigmoid(round(g))) as float32, as the model's Linear + sigmoid in dtype compute it.
    cast: round with casts (inside a Triton kernel, whose lowering has no reduce_precision)."""
    f32 = jnp.float32
    rnd = (lambda v: v.astype(dtype).astype(f32)) if cast else (lambda v: _round(v, dtype).astype(f32))
    return rnd(jax.nn.sigmoid(rnd(g)))


def shared_weight(shared: Shared, x):
    """The shared expert's combine weight [T] float32 (its weight, or its gate's from x)."""
    if shared.gate_w is None:
        return shared.weight.astype(jnp.float32)
    g = jnp.einsum("th,h->t", x, shared.gate_w, precision=dot_precision(x.dtype))  # rounded to x's dtype (_mm)
    return gate_weight(g.astype(jnp.float32), x.dtype)


def check_operands(x, expert_ids, weights, w_in, w_out, act: str, w_layout: str = "in_out",
                   shared: Shared | None = None) -> list[str]:
    """Every problem with the operands (shapes, ranks, dtypes; ids in [0, E) where they are concrete)."""
    bad = []
    if shared is not None and w_in.ndim == 3 and w_out.ndim == 3 and x.ndim == 2:
        for name, a, like in (("w_in", shared.w_in, w_in), ("w_out", shared.w_out, w_out)):
            want = (1, *like.shape[1:])
            if tuple(a.shape) != want or a.dtype != like.dtype:
                bad.append(f"shared {name} must be one expert stored like the routed ones, {want} {like.dtype}, "
                           f"got {tuple(a.shape)} {a.dtype}")
        if (shared.weight is None) == (shared.gate_w is None):
            bad.append("a shared expert needs exactly one of weight and gate_w")
        elif shared.weight is not None and (tuple(shared.weight.shape) != (x.shape[0],)
                                            or not jnp.issubdtype(shared.weight.dtype, jnp.floating)):
            bad.append(f"shared weight must be [{x.shape[0]}] floating point (one per token), got "
                       f"{tuple(shared.weight.shape)} {shared.weight.dtype}")
        elif shared.gate_w is not None and (tuple(shared.gate_w.shape) != (x.shape[1],)
                                            or shared.gate_w.dtype != x.dtype):
            bad.append(f"shared gate_w must be [{x.shape[1]}] {x.dtype} (the gate's Linear H -> 1), got "
                       f"{tuple(shared.gate_w.shape)} {shared.gate_w.dtype}")
    if act not in ACTS:
        bad.append(f"act must be one of {ACTS}, got {act!r}")
    if w_layout not in W_LAYOUTS:
        bad.append(f"w_layout must be one of {W_LAYOUTS}, got {w_layout!r}")
    for name, a, nd in (("x", x, 2), ("expert_ids", expert_ids, 2), ("weights", weights, 2), ("w_in", w_in, 3),
                        ("w_out", w_out, 3)):
        if a.ndim != nd:
            bad.append(f"{name} must have rank {nd}, got shape {tuple(a.shape)}")
    if bad:
        return bad
    t, h = x.shape
    e, hw, n1, inter, h2 = _dims(w_in, w_out, w_layout)
    store_in = "[E, H, N]" if w_layout == "in_out" else "[E, N, H]"
    store_out = "[E, I, H]" if w_layout == "in_out" else "[E, H, I]"
    if expert_ids.shape[0] != t or weights.shape != expert_ids.shape:
        bad.append(f"expert_ids {tuple(expert_ids.shape)} and weights {tuple(weights.shape)} must both be "
                   f"[{t}, k] for x {tuple(x.shape)}")
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        bad.append(f"expert_ids must be integers, got {expert_ids.dtype}")
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        bad.append(f"weights must be floating point, got {weights.dtype}")
    if hw != h or h2 != h:
        bad.append(f"w_in {tuple(w_in.shape)} (stored {store_in}) and w_out {tuple(w_out.shape)} (stored "
                   f"{store_out}) must have hidden size H = {h} (x's)")
    if w_out.shape[0] != e:
        bad.append(f"w_in has {e} experts but w_out {w_out.shape[0]}")
    want_n1 = 2 * inter if act == "silu_glu" else inter
    if act in ACTS and n1 != want_n1:
        what = "gate | up: 2 I" if act == "silu_glu" else "up: I"
        bad.append(f"act {act!r} needs w_in's N = {what} = {want_n1} (I = {inter} from w_out), got {n1}")
    if not (x.dtype == w_in.dtype == w_out.dtype):
        bad.append(f"x, w_in and w_out must share the model dtype, got {x.dtype}, {w_in.dtype}, {w_out.dtype}")
    if expert_ids.ndim == 2 and expert_ids.shape[1] > e:
        bad.append(f"top-k = {expert_ids.shape[1]} choices of distinct experts need k <= E = {e}")
    ids = None
    if not bad:
        try:  # concrete ids are cheap to check; traced ones (under jit) are not
            ids = np.asarray(expert_ids)
        except jax.errors.TracerArrayConversionError:
            pass
    if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= e):
        bad.append(f"expert_ids must lie in [0, {e}), got values in [{ids.min()}, {ids.max()}]")
    return bad


def kernel_problems(hidden: int, inter: int, num_experts: int, top_k: int, dtype,
                    config: MoeConfig | DecodeConfig | None = None) -> list[str]:
    """Why the kernel cannot take this layer (empty: it can); callers route such a layer to
    impl="xla" and say so."""
    bad = []
    for name, d in (("hidden size H", hidden), ("expert intermediate size I", inter)):
        if d % MIN_BLOCK:
            bad.append(f"{name} = {d} is not a multiple of {MIN_BLOCK} (the kernel's smallest block)")
    if jnp.dtype(dtype).name not in DTYPES:
        bad.append(f"dtype {jnp.dtype(dtype).name} (the kernel takes {', '.join(DTYPES)})")
    if num_experts < 1 or top_k < 1:
        bad.append(f"needs E >= 1 experts and k >= 1 choices, got E = {num_experts}, k = {top_k}")
    if config is not None:
        bad += config.problems()
    return bad


# ----------------------------------------------------------------------------------------------
# rounding and the activation (shared by the XLA forms; the kernel spells the same steps)


def _round(v, dtype):
    """A float32 value -> dtype by round to nearest even (`_common.rounded`)."""
    return rounded(v, dtype)


def activate(pre, act: str, dtype):
    """pre [..., N1] (gate | up, or up), already rounded to dtype -> the activation in dtype, rounded
    as pallas_kernels/moe_experts.py's docstring says (shared by every form)."""
    f32 = jnp.float32
    if act == "silu_glu":
        n = pre.shape[-1] // 2
        g, u = pre[..., :n].astype(f32), pre[..., n:].astype(f32)
        s = _round(g * jax.nn.sigmoid(g), dtype).astype(f32)
        return _round(s * u, dtype)
    r = jax.nn.relu(pre.astype(f32))
    return _round(r * r, dtype)


def _act_rounded(sums, act: str, dtype):
    """Inside a kernel: act of the float32 sums [gate, up] (or [up]), each rounded to dtype first, as
    `activate` rounds (with casts: Triton's lowering has no reduce_precision). The epilogue of the
    decode path's, the fused path's and the grouped kernel's first launch."""
    f32 = jnp.float32
    if act == "silu_glu":
        g = sums[0].astype(dtype).astype(f32)
        u = sums[1].astype(dtype).astype(f32)
        s = (g * jax.nn.sigmoid(g)).astype(dtype).astype(f32)
        return (s * u).astype(dtype)
    r = jnp.maximum(sums[0].astype(dtype).astype(f32), 0.0)
    return (r * r).astype(dtype)


def _mm(a, w, lhs: str, batch: str, out: str, w_layout: str):
    """einsum of a (subscripts lhs, contracted over its last) with a weight stored [batch.., in, out]
    (w_layout "out_in": [batch.., out, in]), rounded to a's dtype: XLA accumulates a 16-bit dot in
    float32 and rounds its output once (a float32 output type is not asked for: XLA:CPU has no
    bf16 x bf16 -> f32 dot); full precision for float32."""
    i, o = lhs[-1], out[-1]
    ws = batch + (i + o if w_layout == "in_out" else o + i)
    y = jnp.einsum(f"{lhs},{ws}->{out}", a, w, precision=dot_precision(a.dtype))
    return _round(y.astype(jnp.float32), a.dtype)


def _valid(expert_ids, num_experts):
    return (expert_ids >= 0) & (expert_ids < num_experts)


def combine_choices(o, weights, valid, dtype):
    """o [T, k, H] (dtype) weighted by weights [T, k] and summed over k in float32, rounded once;
    choices of invalid ids add nothing."""
    prod = o.astype(jnp.float32) * weights.astype(jnp.float32)[..., None]
    return _round(jnp.sum(jnp.where(valid[..., None], prod, 0.0), axis=1), dtype)


# ----------------------------------------------------------------------------------------------
# the XLA references: the gathered form and the dense one


def reference(x, expert_ids, weights, w_in, w_out, *, act: str, w_layout: str = "in_out",
              shared: Shared | None = None):
    """The gathered form: each pair's expert weights gathered ([T, k, H, N1], [T, k, I, H]); a
    `shared` expert is one more choice of every token."""
    e = w_in.shape[0]
    ids = jnp.clip(expert_ids, 0, e - 1)
    valid = _valid(expert_ids, e)
    if shared is not None:  # the shared expert as expert E of a weight table of E + 1
        w_in, w_out = jnp.concatenate([w_in, shared.w_in]), jnp.concatenate([w_out, shared.w_out])
        ids = jnp.concatenate([ids, jnp.full((x.shape[0], 1), e, ids.dtype)], axis=1)
        weights = jnp.concatenate([weights.astype(jnp.float32), shared_weight(shared, x)[:, None]], axis=1)
        valid = jnp.concatenate([valid, jnp.ones((x.shape[0], 1), bool)], axis=1)
    pre = _mm(x, w_in[ids], "th", "tk", "tkn", w_layout)
    a = activate(pre, act, x.dtype)
    o = _mm(a, w_out[ids], "tki", "tk", "tkh", w_layout)
    return combine_choices(o, weights, valid, x.dtype)


def dense_reference(x, expert_ids, weights, w_in, w_out, *, act: str, w_layout: str = "in_out"):
    """Every expert on every token ([T, E, ...]), combined with a [T, E] matrix zero off the chosen
    experts (a one-hot sum: an id outside [0, E) selects nothing)."""
    e = w_in.shape[0]
    pre = _mm(x, w_in, "th", "e", "ten", w_layout)
    a = activate(pre, act, x.dtype)
    o = _mm(a, w_out, "tei", "e", "teh", w_layout)
    combine = jnp.sum(jax.nn.one_hot(expert_ids, e, dtype=jnp.float32) * weights.astype(jnp.float32)[..., None],
                      axis=1)  # [T, E]
    return _round(jnp.sum(o.astype(jnp.float32) * combine[..., None], axis=1), x.dtype)
