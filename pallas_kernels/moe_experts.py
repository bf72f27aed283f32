"""The routed experts of a mixture-of-experts layer: each token's top-k expert MLPs, weighted and
summed (Pallas / Triton grouped GEMM + its XLA forms).

    y = expert_mlp(x, expert_ids, weights, w_in, w_out, act=..., impl="xla" | "pallas" | "pallas_interpret",
                   config=None, w_layout="in_out")

x [T, H] tokens (model dtype: bf16 / fp16 / fp32); expert_ids [T, k] int32, distinct within a token
(any repeats across tokens); weights [T, k] float32 combine weights; w_in [E, H, 2I] for
act="silu_glu" (per expert the gate columns, then the up columns) or [E, H, I] for act="relu2"
(NemotronH: up only); w_out [E, I, H]. With w_layout="out_in" the experts are stored as HF holds
them, transposed: w_in [E, 2I | I, H], w_out [E, H, I].

    y[t] = sum_j weights[t, j] * down_e(act(x[t] @ w_in[e]))     e = expert_ids[t, j]
    silu_glu: act(g | u) = silu(g) * u          relu2: act(u) = relu(u)^2

Rounding (every form; `dt` = the model dtype, round(.) = round to nearest even into dt, the
identity for float32):
    g, u = round(x @ w_in[e])                   products accumulated in float32, rounded like a Linear
    silu_glu: a = round(round(silu(g)) * u)     silu computed in float32 from the rounded g, as torch's
              bf16 silu does, then the product of two dt values rounded (HF: act_fn(gate) * up)
    relu2:    a = round(relu(u) * relu(u))      (HF: square(relu(up)))
    o = round(a @ w_out[e])                     float32 accumulation, rounded
    y = round(sum_j float32(weights[t, j]) * float32(o_j))   weighted and summed in float32, rounded once
HF's bf16 module multiplies o by the (bf16) weight and adds the k products into a bf16 buffer one
by one; the float32 sum here rounds once instead (it differs from HF's by bf16 rounding steps).
Float32 matmuls run at full precision (IEEE, no TF32) in every form. An expert id outside
[0, E) adds nothing (HF skips the id E: "not on this rank"); `check_operands` rejects such ids
where they are concrete.

Forms:
- `reference`: the gathered form: each (token, choice) pair's expert weights gathered, only those
  products made. Reads T k expert matrices: the XLA route while T k < E (`xla_form`).
- `dense_reference`: every expert on every token, combined with a [T, E] matrix that is zero off
  the chosen experts: the form every other one is tested against.
- `grouped_xla`: the pairs grouped by expert (`group_pairs`) into row tiles of one expert each
  (padded groups), the tiles' rows and their experts' weights gathered, two batched GEMMs. The
  XLA route from T k >= E.
- the decode path (impl "pallas" / "pallas_interpret" with a `DecodeConfig`; the default while
  T k <= decode_max_pairs): no grouping at all. Each (token, choice) pair is its own row (its
  expert read from expert_ids in the kernel: no sort, no scatter, no XLA prep). Launch (1) over
  (column block, K slice, pair): the pair's token row of x times its expert's w_in columns, the
  activation applied (or float32 partials with a K split); launch (2) over (column block, K
  slice, pair) writing the pair's output row, or with combine "kernel" over (column block,
  token): the program runs the token's k experts one after another in one pipelined loop and
  writes y itself (weighted, summed in float32 in choice order, rounded once), so the layer is
  two launches and nothing else. A K split of launch (1) is added, rounded and activated in
  launch (2)'s loads. The row is padded to MIN_BLOCK with zero rows (tl.dot's smallest side):
  the MMA does wasted work, the memory system none. Reads T k expert matrices (one per pair,
  repeats included): what a decode step reads when its tokens' choices rarely coincide.
- the grouped kernel (impl "pallas" / "pallas_interpret" with a `MoeConfig`): the grouping of
  grouped_xla; two launches over (tile, output column block, K slice): (1) the tile's rows of x
  gathered by token times the tile's expert's w_in columns, the activation applied, written to
  the sorted rows of h [pairs, I];
  (2) h's rows (contiguous) times w_out. Each program streams its expert's weight block once
  (`block_k` rows a step, `num_stages` deep); an empty tile writes nothing. The weighted sum
  over the k choices is one XLA gather + reduce. Why two launches, not one fused: a fused
  program needs all of its tile's h, so it would read the whole of w_in per output block, or
  run one program a tile: 8 programs on 132 SMs at decode (T = 1, k = 8).

Grouping (`group_pairs`): pair p = t k + j goes to sorted row s_p = its rank by (expert, p) (a
stable sort by expert); the row tiles partition each expert's rows into tiles of `block_m`
(static count ceil(T k / block_m) + min(T k, E): every tile but one per expert is full); a
tile is (expert, first sorted row, rows), rows 0 for the unused ones. Ranks come from one
comparison count over the pairs (one XLA fusion; no sort kernel) up to RANK_BY_COUNT_MAX_PAIRS
pairs, from a stable argsort above.

Why a kernel: on the H200 (jax 0.11.2, one Qwen3.6-35B-A3B expert layer, bf16, one token, 8
experts: 8 x 6.3 MB of weights, roofline 23.8 us as issue #26 states it) XLA's gather form took
163-184 us, `lax.ragged_dot` 533-558 us and the dense form 535-572 us; at 33 tokens the gather and
ragged forms did not finish within ~200 s. Neither XLA primitive reads only the touched experts'
weights. scripts/bench/moe_experts.py times every form here against the kernels.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import cdiv, check_impl, compiler_params, dot_precision, is_pow2, load, next_pow2, store

ACTS = ("silu_glu", "relu2")
W_LAYOUTS = ("in_out", "out_in")  # [E, in, out] (the project's Linear layout) or [E, out, in] (HF's)
GEMM_LAYOUTS = ("cols", "rows")
DTYPES = ("bfloat16", "float16", "float32")
MIN_BLOCK = 16  # Triton's tl.dot needs every block dimension >= 16
RANK_BY_COUNT_MAX_PAIRS = 16384  # up to here a pair's sorted row is a comparison count (P^2 compares)
TARGET_PROGRAMS = 256  # ~two programs per SM of the H200's 132, all resident at once: loads in flight
DECODE_MAX_PAIRS = 8  # the decode path up to this many (token, choice) pairs: one token at top-8 (decision 0039)
COMBINES = ("kernel", "xla")


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tiling of one of the kernel's two launches. block_n / block_k are upper bounds: a launch
    uses the largest power of two <= them that divides its N / K (`fit`). split_k > 1 splits K
    into that many slices (a power of two dividing K / block_k) whose float32 partial products
    XLA adds (then rounds, and for the first launch applies the activation). layout "cols" puts
    the weight columns on the MMA's M side (w^T x^T: the few rows of a tile are its N side),
    "rows" is the plain x @ w."""

    block_n: int = 64
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    layout: str = "cols"

    def problems(self, name: str) -> list[str]:
        bad = [f"{name}.{f} = {getattr(self, f)} (a power of two >= {MIN_BLOCK})" for f in ("block_n", "block_k")
               if not (is_pow2(getattr(self, f)) and getattr(self, f) >= MIN_BLOCK)]
        bad += [] if is_pow2(self.split_k) else [f"{name}.split_k = {self.split_k} (a power of two)"]
        bad += [] if self.layout in GEMM_LAYOUTS else [f"{name}.layout = {self.layout!r} (one of {GEMM_LAYOUTS})"]
        bad += [] if self.num_warps in (1, 2, 4, 8, 16) else [f"{name}.num_warps = {self.num_warps}"]
        bad += [] if self.num_stages >= 1 else [f"{name}.num_stages = {self.num_stages}"]
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
    (x @ w_in, activation), `down` the second (h @ w_out)."""

    block_m: int = 16
    up: GemmConfig = GemmConfig()
    down: GemmConfig = GemmConfig()

    def problems(self) -> list[str]:
        bad = [] if is_pow2(self.block_m) and self.block_m >= MIN_BLOCK else [
            f"block_m = {self.block_m} (a power of two >= {MIN_BLOCK})"]
        return bad + self.up.problems("up") + self.down.problems("down")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """The decode path's tiling (no grouping; module docstring). `up`: launch (1) over (column
    block, K slice, pair); its split_k > 1 writes float32 partials that launch (2) adds, rounds and
    activates as it loads them. `down`: launch (2). combine "kernel": one program per (column
    block, token) runs the token's k choices and writes y (down.split_k must be 1); "xla": one
    program per (column block, K slice, pair) writes the pair's rounded output (or float32
    partials), which XLA adds up, weights and sums over k (one more fusion). Each GemmConfig's
    layout names the MMA form of the padded row ("cols": weight columns on the MMA's M side)."""

    up: GemmConfig = GemmConfig(block_n=64, block_k=64, split_k=4)
    down: GemmConfig = GemmConfig(block_n=64, block_k=64)
    combine: str = "kernel"

    def problems(self) -> list[str]:
        bad = self.up.problems("up") + self.down.problems("down")
        if self.combine not in COMBINES:
            bad.append(f"combine = {self.combine!r} (one of {COMBINES})")
        elif self.combine == "kernel" and self.down.split_k != 1:
            bad.append(f"down.split_k = {self.down.split_k} with combine 'kernel' (its program sums whole rows: 1)")
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


def default_config(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int) -> MoeConfig:
    """The tiling for T tokens (not measured yet: the first guess that the GPU script sweeps).
    block_m: a power of two >= 1.5 x the mean rows of a touched expert (T k / min(T k, E)), in
    16..64, so most experts' rows fit one tile and their weights are read once. Columns in blocks
    of 64; K split (in powers of two) until each launch has ~2 programs per SM, counting
    min(T k, E) experts' tiles (decode: 8 experts x 8 column blocks of I = 512 -> K split 4)."""
    if hidden % MIN_BLOCK or inter % MIN_BLOCK:
        return MoeConfig()  # the kernel refuses the shape (kernel_problems)
    pairs = tokens * top_k
    groups = max(1, min(pairs, num_experts))
    block_m = min(64, max(MIN_BLOCK, next_pow2(cdiv(3 * pairs, 2 * groups))))
    tiles = groups * cdiv(cdiv(pairs, groups), block_m)
    up = GemmConfig(layout="cols" if block_m <= 32 else "rows").fit(inter, hidden)
    down = GemmConfig(layout=up.layout).fit(hidden, inter)
    up = dataclasses.replace(up, split_k=_filling_split(tiles * (inter // up.block_n), hidden, up.block_k))
    down = dataclasses.replace(down, split_k=_filling_split(tiles * (hidden // down.block_n), inter, down.block_k))
    return MoeConfig(block_m=block_m, up=up, down=down)


def default_decode_config(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int) -> DecodeConfig:
    """The decode path's tiling for T tokens (a first guess until the H200 sweep of
    scripts.bench.moe_experts sets it). Column blocks of 64 (128-byte rows of [E, in, out]
    weights); launch (1) split in K until it has ~TARGET_PROGRAMS programs (T = 1, top-8, I = 512:
    8 pairs x 8 blocks x split 4). Launch (2) combines in the kernel once T x H / 64 programs reach
    half of that (T >= 4 at H = 2048), else one program per pair and XLA's combine."""
    del num_experts
    if hidden % MIN_BLOCK or inter % MIN_BLOCK:
        return DecodeConfig()  # the kernel refuses the shape (kernel_problems)
    pairs = tokens * top_k
    up = GemmConfig(block_n=64, block_k=64).fit(inter, hidden)
    up = dataclasses.replace(up, split_k=_filling_split(pairs * (inter // up.block_n), hidden, up.block_k))
    down = GemmConfig(block_n=64, block_k=64).fit(hidden, inter)
    if tokens * (hidden // down.block_n) >= TARGET_PROGRAMS // 2:
        return DecodeConfig(up=up, down=down, combine="kernel")
    down = dataclasses.replace(down, split_k=_filling_split(pairs * (hidden // down.block_n), inter, down.block_k))
    return DecodeConfig(up=up, down=down, combine="xla")


def kernel_config(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                  decode_max_pairs: int = DECODE_MAX_PAIRS) -> MoeConfig | DecodeConfig:
    """The kernel route's default: the decode path while T k <= decode_max_pairs, else the grouped
    kernel."""
    if tokens * top_k <= decode_max_pairs:
        return default_decode_config(tokens, top_k, num_experts, hidden, inter)
    return default_config(tokens, top_k, num_experts, hidden, inter)


def max_tiles(pairs: int, num_experts: int, block_m: int) -> int:
    """Static tile count: every expert's rows in tiles of block_m, at most one partial tile per
    touched expert (and at most min(pairs, E) experts are touched)."""
    return cdiv(pairs, block_m) + min(pairs, num_experts)


def xla_form(tokens: int, top_k: int, num_experts: int) -> str:
    """impl="xla"'s choice: the gathered `reference` while the T k pairs are fewer than the E experts
    (it reads one expert matrix per pair, <= E; no sort), `grouped_xla` from T k >= E (it reads each
    touched expert once per tile of rows)."""
    return "reference" if tokens * top_k < num_experts else "grouped_xla"


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


def check_operands(x, expert_ids, weights, w_in, w_out, act: str, w_layout: str = "in_out") -> list[str]:
    """Every problem with the operands (shapes, ranks, dtypes; ids in [0, E) where they are concrete)."""
    bad = []
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
    """A float32 value -> dtype by round to nearest even. reduce_precision first: under jit XLA may drop a
    bare f32 -> 16-bit -> f32 round trip (its excess precision), which would skip the rounding."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return v.astype(jnp.float32)
    info = jnp.finfo(dtype)
    return lax.reduce_precision(v.astype(jnp.float32), info.nexp, info.nmant).astype(dtype)


def activate(pre, act: str, dtype):
    """pre [..., N1] (gate | up, or up), already rounded to dtype -> the activation in dtype, rounded
    as the module docstring says (shared by every form)."""
    f32 = jnp.float32
    if act == "silu_glu":
        n = pre.shape[-1] // 2
        g, u = pre[..., :n].astype(f32), pre[..., n:].astype(f32)
        s = _round(g * jax.nn.sigmoid(g), dtype).astype(f32)
        return _round(s * u, dtype)
    r = jax.nn.relu(pre.astype(f32))
    return _round(r * r, dtype)


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
# XLA forms


def reference(x, expert_ids, weights, w_in, w_out, *, act: str, w_layout: str = "in_out"):
    """The gathered form: each pair's expert weights gathered ([T, k, H, N1], [T, k, I, H])."""
    e = w_in.shape[0]
    ids = jnp.clip(expert_ids, 0, e - 1)
    pre = _mm(x, w_in[ids], "th", "tk", "tkn", w_layout)
    a = activate(pre, act, x.dtype)
    o = _mm(a, w_out[ids], "tki", "tk", "tkh", w_layout)
    return combine_choices(o, weights, _valid(expert_ids, e), x.dtype)


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


class PairGroups(NamedTuple):
    """The (token, choice) pairs grouped by expert and cut into row tiles (`group_pairs`)."""

    sorted_row: jax.Array  # [P] int32: pair p's row in expert order
    token: jax.Array  # [P + block_m] int32: the token of each sorted row (0 past the last pair)
    tile_expert: jax.Array  # [tiles] int32
    tile_row: jax.Array  # [tiles] int32: the tile's first sorted row
    tile_rows: jax.Array  # [tiles] int32: its rows (0: an unused tile)
    expert_tile: jax.Array  # [E] int32: each expert's first tile
    expert_row: jax.Array  # [E] int32: each expert's first sorted row
    valid: jax.Array  # [T, k] bool: ids in [0, E)


def group_pairs(expert_ids, num_experts: int, block_m: int, rank_by_count_max: int = RANK_BY_COUNT_MAX_PAIRS
                ) -> PairGroups:
    """Sort the pairs by expert (stable) and cut each expert's rows into tiles of block_m.
    Pairs with an id outside [0, E) sort last and belong to no tile."""
    t, k = expert_ids.shape
    p = t * k
    i32 = jnp.int32
    valid = _valid(expert_ids, num_experts)
    ids = jnp.where(valid, expert_ids, num_experts).reshape(p).astype(i32)
    pair = jnp.arange(p, dtype=i32)
    if p <= rank_by_count_max and (num_experts + 1) * p < 2**31:
        key = ids * p + pair  # distinct; ordered by (expert, pair)
        sorted_row = jnp.sum((key[None, :] < key[:, None]).astype(i32), axis=1)
    else:
        order = jnp.argsort(ids, stable=True).astype(i32)
        sorted_row = jnp.zeros((p,), i32).at[order].set(pair, unique_indices=True)
    token = jnp.zeros((p + block_m,), i32).at[sorted_row].set(pair // k, unique_indices=True)
    experts = jnp.arange(num_experts, dtype=i32)
    counts = jnp.sum((ids[None, :] == experts[:, None]).astype(i32), axis=1)  # [E]
    starts = jnp.cumsum(counts) - counts
    tiles_e = (counts + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles_e)  # tiles of experts <= e
    m = max_tiles(p, num_experts, block_m)
    tile = jnp.arange(m, dtype=i32)
    te = jnp.minimum(jnp.sum((tile_end[None, :] <= tile[:, None]).astype(i32), axis=1), num_experts - 1)
    local = tile - (tile_end[te] - tiles_e[te])
    rows = jnp.clip(counts[te] - local * block_m, 0, block_m)
    used = tile < tile_end[-1]
    return PairGroups(sorted_row, token, jnp.where(used, te, 0), jnp.where(used, starts[te] + local * block_m, 0),
                      jnp.where(used, rows, 0), tile_end - tiles_e, starts, valid)


def _combine_sorted(out_sorted, groups: PairGroups, weights, dtype):
    """The rows of out_sorted [>= P, H] back in pair order, weighted and summed over k."""
    t, k = weights.shape
    o = jnp.take(out_sorted, groups.sorted_row, axis=0).reshape(t, k, -1)
    return combine_choices(o, weights, groups.valid, dtype)


def grouped_xla(x, expert_ids, weights, w_in, w_out, *, act: str, w_layout: str = "in_out",
                block_m: int | None = None):
    """The grouped form in XLA: the row tiles of `group_pairs` (block_m rows each, default as the
    kernel's) as a batch: [tiles, block_m, H] rows gathered by token, [tiles, H, N1] / [tiles, I, H]
    weights gathered by the tiles' experts, two batched GEMMs (an unused tile reads expert 0)."""
    t, k = expert_ids.shape
    e, h, _, inter, _ = _dims(w_in, w_out, w_layout)
    bm = block_m or default_config(t, k, e, h, inter).block_m
    g = group_pairs(expert_ids, e, bm)
    r = jnp.arange(bm, dtype=jnp.int32)
    rows = g.tile_row[:, None] + r[None, :]  # [tiles, bm] sorted rows (< P + bm)
    xt = jnp.take(x, g.token[rows], axis=0)  # [tiles, bm, H]
    pre = _mm(xt, w_in[g.tile_expert], "mrh", "m", "mrn", w_layout)
    a = activate(pre, act, x.dtype)
    o = _mm(a, w_out[g.tile_expert], "mri", "m", "mrh", w_layout)
    # pair p (expert e, sorted row s) is row (s - e's first row) % bm of e's tile (s - first row) // bm
    ids = jnp.where(g.valid, expert_ids, 0).reshape(-1)
    local = g.sorted_row - g.expert_row[ids]
    tile = jnp.clip(g.expert_tile[ids] + local // bm, 0, o.shape[0] - 1)  # (invalid pairs: any tile)
    o_pairs = o[tile, local % bm].reshape(t, k, -1)
    return combine_choices(o_pairs, weights, g.valid, x.dtype)


# ----------------------------------------------------------------------------------------------
# the kernel


def _gemm_kernel(exp_ref, row_ref, cnt_ref, tok_ref, x_ref, w_ref, o_ref, *, bm, cfg: GemmConfig, k_per_split,
                 col_offsets, gather, w_t, precision, epilogue, act):
    """One (tile, column block, K slice) program. gather: x_ref is x [T, H] and the tile's rows are
    gathered by token; else x_ref holds the sorted rows (h). col_offsets: the weight column groups
    multiplied (gate, up) or (up,) / (all,). epilogue "act": write act(round(.)) into o_ref [P', I];
    "round": write round(.) into o_ref [P', N]; "partial": write the float32 sums (split K)."""
    f32, i32 = jnp.float32, jnp.int32
    bn, bk = cfg.block_n, cfg.block_k
    tile, col_block, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = cnt_ref[tile]

    @pl.when(rows > 0)
    def _():
        e = exp_ref[tile]
        r0 = row_ref[tile]
        col0 = col_block * bn
        k_base = split * k_per_split
        kk = lax.broadcasted_iota(i32, (bk,), 0)
        tok = load(tok_ref, (pl.ds(r0, bm),)) if gather else None

        def step(t, accs):
            k0 = k_base + t * bk
            if gather:  # the tile's rows of x, by token (integer-array load: a gather)
                xt = load(x_ref, (tok[:, None], (k0 + kk)[None, :]))
            else:
                xt = load(x_ref, (pl.ds(r0, bm), pl.ds(k0, bk)))
            out = []
            for off, acc in zip(col_offsets, accs):
                if w_t:  # stored [E, N, K]: a [bn, bk] tile
                    w = load(w_ref, (e, pl.ds(off + col0, bn), pl.ds(k0, bk)))
                else:
                    w = load(w_ref, (e, pl.ds(k0, bk), pl.ds(off + col0, bn)))
                wk = 1 if w_t else 0  # the weight tile's contraction axis
                if cfg.layout == "rows":
                    part = lax.dot_general(xt, w, (((1,), (wk,)), ((), ())), precision=precision,
                                           preferred_element_type=f32)
                else:  # [bn, bm]: the weight columns on the MMA's M side
                    part = lax.dot_general(w, xt, (((wk,), (1,)), ((), ())), precision=precision,
                                           preferred_element_type=f32)
                out.append(acc + part)
            return tuple(out)

        shape = (bm, bn) if cfg.layout == "rows" else (bn, bm)
        accs = lax.fori_loop(0, k_per_split // bk, step, tuple(jnp.zeros(shape, f32) for _ in col_offsets))
        accs = [a if cfg.layout == "rows" else a.T for a in accs]  # [bm, bn]
        mask = lax.broadcasted_iota(i32, (bm, bn), 0) < rows
        if epilogue == "partial":
            for off, acc in zip(col_offsets, accs):
                store(o_ref, (pl.ds(r0, bm), pl.ds(off + col0, bn)), acc, mask=mask)
            return
        dtype = o_ref.dtype
        if epilogue == "round":
            y = accs[0].astype(dtype)
        elif act == "silu_glu":
            g = accs[0].astype(dtype).astype(f32)
            u = accs[1].astype(dtype).astype(f32)
            s = (g * jax.nn.sigmoid(g)).astype(dtype).astype(f32)
            y = (s * u).astype(dtype)
        else:
            r = jnp.maximum(accs[0].astype(dtype).astype(f32), 0.0)
            y = (r * r).astype(dtype)
        store(o_ref, (pl.ds(r0, bm), pl.ds(col0, bn)), y, mask=mask)


def _launch(groups: PairGroups, lhs, w, *, n_out: int, k: int, cfg: GemmConfig, bm: int, gather: bool, w_t: bool,
            col_offsets, epilogue: str, act: str, out_dtype, interpret: bool, name: str):
    """One grouped GEMM launch over grid (tiles, n_out / block_n, split_k). With split_k > 1 the
    output is [split_k, P + bm, width] float32 partials (width: every column group's columns)."""
    rows_out = groups.token.shape[0]  # P + bm: every tile's row block lies inside
    tiles = groups.tile_expert.shape[0]
    split = cfg.split_k
    k_per_split = k // split
    kernel = functools.partial(_gemm_kernel, bm=bm, cfg=cfg, k_per_split=k_per_split, col_offsets=col_offsets,
                               gather=gather, w_t=w_t, precision=dot_precision(lhs.dtype),
                               epilogue="partial" if split > 1 else epilogue, act=act)
    full = lambda a: pl.BlockSpec(a.shape, lambda i, j, s: (0,) * a.ndim)
    if split > 1:
        width = n_out * len(col_offsets)
        out_shape = jax.ShapeDtypeStruct((split, rows_out, width), jnp.float32)
        out_spec = pl.BlockSpec((None, rows_out, width), lambda i, j, s: (s, 0, 0))
    else:
        out_shape = jax.ShapeDtypeStruct((rows_out, n_out), out_dtype)
        out_spec = pl.BlockSpec((rows_out, n_out), lambda i, j, s: (0, 0))
    operands = (groups.tile_expert, groups.tile_row, groups.tile_rows, groups.token, lhs, w)
    return pl.pallas_call(
        kernel,
        grid=(tiles, n_out // cfg.block_n, split),
        in_specs=[full(a) for a in operands],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=None if interpret else compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name=name,
    )(*operands)


def _pallas(x, expert_ids, weights, w_in, w_out, *, act: str, w_layout: str, config: MoeConfig | None,
            interpret: bool):
    t, k = expert_ids.shape
    e, h, _, inter, _ = _dims(w_in, w_out, w_layout)
    cfg = config or default_config(t, k, e, h, inter)
    bad = kernel_problems(h, inter, e, k, x.dtype, cfg)
    if bad:
        raise ValueError("expert_mlp kernel: " + "; ".join(bad) + " (use impl='xla')")
    bm = cfg.block_m
    up, down = cfg.up.fit(inter, h), cfg.down.fit(h, inter)
    groups = group_pairs(expert_ids, e, bm)
    w_t = w_layout == "out_in"
    offsets = (0, inter) if act == "silu_glu" else (0,)
    common = dict(bm=bm, w_t=w_t, act=act, out_dtype=x.dtype, interpret=interpret)
    hid = _launch(groups, x, w_in, n_out=inter, k=h, cfg=up, gather=True, col_offsets=offsets, epilogue="act",
                  name="moe_experts_up", **common)
    if up.split_k > 1:  # float32 partials of gate | up (or up): added, rounded and activated here
        hid = activate(_round(jnp.sum(hid, axis=0), x.dtype), act, x.dtype)
    out = _launch(groups, hid, w_out, n_out=h, k=inter, cfg=down, gather=False, col_offsets=(0,),
                  epilogue="round", name="moe_experts_down", **common)
    if down.split_k > 1:
        out = _round(jnp.sum(out, axis=0), x.dtype)
    return _combine_sorted(out, groups, weights, x.dtype)


# ----------------------------------------------------------------------------------------------
# the decode path: one row per (token, choice) pair, no grouping


def _padded_row(row):
    """A [1, K] row -> [MIN_BLOCK, K]: the row, then zero rows (tl.dot's smallest side). The
    product's other rows are then exact zeros, so a sum over them gives the row's product."""
    rows = jnp.broadcast_to(row, (MIN_BLOCK, row.shape[1]))
    first = lax.broadcasted_iota(jnp.int32, rows.shape, 0) == 0
    return jnp.where(first, rows, jnp.zeros_like(rows))


def _row_product(w, rows, w_t: bool, layout: str, precision):
    """w's tile ([bk, bn], or [bn, bk] for weights stored [E, out, in]) against the padded rows
    [MIN_BLOCK, bk], float32: [bn, MIN_BLOCK] ("cols": the weight columns on the MMA's M side) or
    [MIN_BLOCK, bn] ("rows")."""
    wk = 1 if w_t else 0  # the tile's contraction axis
    if layout == "rows":
        return lax.dot_general(rows, w, (((1,), (wk,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)
    return lax.dot_general(w, rows, (((wk,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _the_row(acc, layout: str):
    """The padded product's one real row as a [bn] vector (the other rows are zeros)."""
    return jnp.sum(acc, axis=1 if layout == "cols" else 0)


def _weight_tile(w_ref, e, k0, col, bk: int, bn: int, w_t: bool):
    if w_t:  # stored [E, N, K]
        return load(w_ref, (e, pl.ds(col, bn), pl.ds(k0, bk)))
    return load(w_ref, (e, pl.ds(k0, bk), pl.ds(col, bn)))


def _decode_up_kernel(ids_ref, x_ref, w_ref, o_ref, *, top_k, num_experts, cfg: GemmConfig, k_per_split,
                      col_offsets, w_t, precision, act):
    """Program (column block, K slice, pair): the pair's token row of x times its expert's w_in
    columns (gate and up, or up). Without a K split: act(round(.)) into o_ref [P, I]; with one:
    the float32 sums into o_ref [S, P, N1]. A pair with an id outside [0, E) writes nothing."""
    bn, bk = cfg.block_n, cfg.block_k
    col_block, split, pair = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tok, choice = pair // top_k, pair % top_k
    e = ids_ref[tok, choice]

    @pl.when((e >= 0) & (e < num_experts))
    def _():
        col0 = col_block * bn
        k_base = split * k_per_split

        def step(i, accs):
            k0 = k_base + i * bk
            rows = _padded_row(load(x_ref, (pl.ds(tok, 1), pl.ds(k0, bk))))
            return tuple(acc + _row_product(_weight_tile(w_ref, e, k0, off + col0, bk, bn, w_t), rows, w_t,
                                            cfg.layout, precision)
                         for off, acc in zip(col_offsets, accs))

        shape = (bn, MIN_BLOCK) if cfg.layout == "cols" else (MIN_BLOCK, bn)
        accs = lax.fori_loop(0, k_per_split // bk, step, tuple(jnp.zeros(shape, jnp.float32) for _ in col_offsets))
        sums = [_the_row(a, cfg.layout) for a in accs]
        if cfg.split_k > 1:
            for off, v in zip(col_offsets, sums):
                store(o_ref, (split, pair, pl.ds(off + col0, bn)), v)
            return
        store(o_ref, (pair, pl.ds(col0, bn)), _act_rounded(sums, act, o_ref.dtype))


def _act_rounded(sums, act: str, dtype):
    """act of the float32 sums [gate, up] (or [up]), each rounded to dtype first (module docstring)."""
    f32 = jnp.float32
    if act == "silu_glu":
        g = sums[0].astype(dtype).astype(f32)
        u = sums[1].astype(dtype).astype(f32)
        s = (g * jax.nn.sigmoid(g)).astype(dtype).astype(f32)
        return (s * u).astype(dtype)
    r = jnp.maximum(sums[0].astype(dtype).astype(f32), 0.0)
    return (r * r).astype(dtype)


def _decode_down_kernel(ids_ref, wts_ref, h_ref, w_ref, o_ref, *, top_k, kp, num_experts, cfg: GemmConfig,
                        k_per_split, per_token, h_split, inter, w_t, precision, act):
    """Launch (2). per_token: program (column block, 0, token) runs the token's k choices in one
    loop of k x (I / bk) steps (the expert changes every I / bk steps, so the weight loads stay
    pipelined across experts) and writes round(sum_j w_j round(o_j)) into o_ref [T, H]. Else
    program (column block, K slice, pair) writes the pair's round(o) into o_ref [P, H] (float32
    partials [S, P, H] with a K split). h_ref: the activation [P, I] (dtype), or launch (1)'s
    float32 partials [h_split, P, N1], added, rounded and activated here as they are loaded."""
    f32, i32 = jnp.float32, jnp.int32
    bn, bk = cfg.block_n, cfg.block_k
    col_block, split, row = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    col0 = col_block * bn
    k_base = split * k_per_split
    nk = k_per_split // bk

    def activation(pair, k0):
        if h_split == 0:
            return load(h_ref, (pl.ds(pair, 1), pl.ds(k0, bk)))
        parts = [jnp.sum(load(h_ref, (pl.ds(0, h_split), pair, pl.ds(off + k0, bk))), axis=0)
                 for off in ((0, inter) if act == "silu_glu" else (0,))]
        return _act_rounded(parts, act, w_ref.dtype)[None, :]

    shape = (bn, MIN_BLOCK) if cfg.layout == "cols" else (MIN_BLOCK, bn)
    if per_token:
        jj = lax.broadcasted_iota(i32, (kp,), 0)
        at = (jnp.zeros((kp,), i32) + row, jnp.minimum(jj, top_k - 1))  # the token's k choices (padded to kp)
        ids = load(ids_ref, at)
        valid = (jj < top_k) & (ids >= 0) & (ids < num_experts)
        wts = jnp.where(valid, load(wts_ref, at).astype(f32), 0.0)

        def step(i, carry):
            acc, y = carry
            j = i // nk
            k0 = k_base + (i - j * nk) * bk
            pick = jj == j
            e = jnp.clip(jnp.sum(jnp.where(pick, ids, 0)), 0, num_experts - 1)
            rows = _padded_row(activation(row * top_k + j, k0))
            acc = acc + _row_product(_weight_tile(w_ref, e, k0, col0, bk, bn, w_t), rows, w_t, cfg.layout, precision)
            last = i - j * nk == nk - 1
            add = last & (jnp.sum(jnp.where(pick, valid.astype(i32), 0)) > 0)
            o = acc.astype(o_ref.dtype).astype(f32)
            y = jnp.where(add, y + jnp.sum(jnp.where(pick, wts, 0.0)) * o, y)
            return jnp.where(last, jnp.zeros_like(acc), acc), y

        zeros = jnp.zeros(shape, f32)
        _, y = lax.fori_loop(0, top_k * nk, step, (zeros, zeros))
        store(o_ref, (row, pl.ds(col0, bn)), _the_row(y, cfg.layout).astype(o_ref.dtype))
        return

    tok, choice = row // top_k, row % top_k
    e = ids_ref[tok, choice]

    @pl.when((e >= 0) & (e < num_experts))
    def _():
        def step(i, acc):
            k0 = k_base + i * bk
            rows = _padded_row(activation(row, k0))
            return acc + _row_product(_weight_tile(w_ref, e, k0, col0, bk, bn, w_t), rows, w_t, cfg.layout,
                                      precision)

        v = _the_row(lax.fori_loop(0, nk, step, jnp.zeros(shape, f32)), cfg.layout)
        if cfg.split_k > 1:
            store(o_ref, (split, row, pl.ds(col0, bn)), v)
        else:
            store(o_ref, (row, pl.ds(col0, bn)), v.astype(o_ref.dtype))


def _call(kernel, grid, operands, out_shape, cfg: GemmConfig, interpret: bool, name: str):
    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * len(a.shape))
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[full(a) for a in operands],
        out_specs=full(out_shape),
        out_shape=out_shape,
        compiler_params=None if interpret else compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name=name,
    )(*operands)


def _decode(x, expert_ids, weights, w_in, w_out, *, act: str, w_layout: str, config: DecodeConfig, interpret: bool):
    """The decode path (module docstring): two launches, plus XLA's combine with combine "xla"."""
    t, k = expert_ids.shape
    e, h, _, inter, _ = _dims(w_in, w_out, w_layout)
    bad = kernel_problems(h, inter, e, k, x.dtype, config)
    if bad:
        raise ValueError("expert_mlp kernel: " + "; ".join(bad) + " (use impl='xla')")
    up, down = config.up.fit(inter, h), config.down.fit(h, inter)
    per_token = config.combine == "kernel"
    if per_token:
        down = dataclasses.replace(down, split_k=1)
    ids = expert_ids.astype(jnp.int32)
    wts = weights.astype(jnp.float32)
    w_t = w_layout == "out_in"
    p = t * k
    offsets = (0, inter) if act == "silu_glu" else (0,)
    precision = dot_precision(x.dtype)
    f32 = jnp.float32
    if up.split_k > 1:
        hid_shape = jax.ShapeDtypeStruct((up.split_k, p, len(offsets) * inter), f32)
    else:
        hid_shape = jax.ShapeDtypeStruct((p, inter), x.dtype)
    up_kernel = functools.partial(_decode_up_kernel, top_k=k, num_experts=e, cfg=up, k_per_split=h // up.split_k,
                                  col_offsets=offsets, w_t=w_t, precision=precision, act=act)
    hid = _call(up_kernel, (inter // up.block_n, up.split_k, p), (ids, x, w_in), hid_shape, up, interpret,
                "moe_decode_up")
    down_kernel = functools.partial(_decode_down_kernel, top_k=k, kp=next_pow2(k), num_experts=e, cfg=down,
                                    k_per_split=inter // down.split_k, per_token=per_token,
                                    h_split=up.split_k if up.split_k > 1 else 0, inter=inter, w_t=w_t,
                                    precision=precision, act=act)
    if per_token:
        return _call(down_kernel, (h // down.block_n, 1, t), (ids, wts, hid, w_out),
                     jax.ShapeDtypeStruct((t, h), x.dtype), down, interpret, "moe_decode_down")
    if down.split_k > 1:
        out_shape = jax.ShapeDtypeStruct((down.split_k, p, h), f32)
    else:
        out_shape = jax.ShapeDtypeStruct((p, h), x.dtype)
    out = _call(down_kernel, (h // down.block_n, down.split_k, p), (ids, wts, hid, w_out), out_shape, down,
                interpret, "moe_decode_down")
    if down.split_k > 1:
        out = _round(jnp.sum(out, axis=0), x.dtype)
    return combine_choices(out.reshape(t, k, h), wts, _valid(ids, e), x.dtype)


def expert_mlp(x, expert_ids, weights, w_in, w_out, *, act: str, impl: str = "xla",
               config: MoeConfig | DecodeConfig | None = None, w_layout: str = "in_out",
               decode_max_pairs: int = DECODE_MAX_PAIRS):
    """y [T, H] = sum_j weights[t, j] * down_e(act(x[t] @ w_in[e])), e = expert_ids[t, j], rounded
    as the module docstring says. impl "xla": `xla_form`'s choice of reference / grouped_xla;
    "pallas" / "pallas_interpret": the decode path (config a DecodeConfig) or the grouped kernel
    (a MoeConfig); default `kernel_config`: the decode path while T k <= decode_max_pairs. A layer
    the kernels cannot take (`kernel_problems`) raises. Pure and jit-compatible (config, act, impl,
    w_layout and decode_max_pairs static)."""
    check_impl(impl)
    bad = check_operands(x, expert_ids, weights, w_in, w_out, act, w_layout)
    if bad:
        raise ValueError("expert_mlp: " + "; ".join(bad))
    if impl == "xla":
        t, k = expert_ids.shape
        form = reference if xla_form(t, k, w_in.shape[0]) == "reference" else grouped_xla
        return form(x, expert_ids, weights, w_in, w_out, act=act, w_layout=w_layout)
    t, k = expert_ids.shape
    e, h, _, inter, _ = _dims(w_in, w_out, w_layout)
    config = config or kernel_config(t, k, e, h, inter, decode_max_pairs)
    run = _decode if isinstance(config, DecodeConfig) else _pallas
    return run(x, expert_ids, weights, w_in, w_out, act=act, w_layout=w_layout, config=config,
               interpret=impl == "pallas_interpret")
