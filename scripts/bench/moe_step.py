"""The MoE figures of scripts.bench.e2e on a target whose FFNs are sparse MoE blocks (--shape
35b-a3b): which experts a step reads, what its roofline is, and what the expert products cost.

Routing probe (bench only; the library is unchanged): one jitted call runs the DDTree step's draft,
the tree builds of every budget and the verify of the largest from the benchmark's loop state,
with each SparseMoeBlock's `route` wrapped (an instance attribute of the model merged inside the
call) so that every MoE layer's input rows, chosen experts and combine weights come back as
outputs. From it:
  - decode: the tree roots are the decode step's tokens (the bonus token at the committed length,
    the same caches), so their routing is the decode step's;
  - budget B: its tree holds the top-B prefixes of the same draft log-probs, a subset of the
    largest budget's nodes (matched by token path); a node's hidden states depend only on its
    ancestors and the context, so its routing is read off the largest tree's verify (that wider
    pass rounds some products differently, which may flip a near-tied choice: the counts are
    statistics, not bit-exact replays).
Distinct experts of a layer = the union over every row and node of the step (what the kernels read
once per step); reported as the mean over MoE layers, and its ratio to decode's.

Roofline of the decode step: the dense weights (everything but the expert stacks and the embedding
table) + the chosen experts (sum over layers of distinct x expert bytes) + K / V + recurrent state.

Expert products alone (`expert_times`): every MoE layer's expert product on the probe's rows and
routing for that step (each layer its own weights: nothing stays in L2), in one on-device loop timed
in n / 2n pairs (the marginal iteration), against the touched-expert bytes / the run's read rate:
the issue's verify bound (<= 1.3x).

Correlated routing (trained routers overlap along a sequence; random routing overstates distinct
experts): a stand-in in which every node shares `shared_of(k)` of its k experts (6 of 8, as the
kernel bench's correlated rows) with the node before it in its row (node order: root, then by
depth; a chain through the tree, which adds k - shared new draws a node as sharing with the parent
would), the new ones drawn from the experts the previous node did not choose, rows independent.
Two figures:
  - estimate (always): the step time with the expert products' time under the probe's routing
    replaced by their time under the stand-in (both timed alone on the same rows);
  - timed (`--moe-correlated-steps`): the DDTree step timed whole with the stand-in router in the
    model (ids from the stand-in table relabelled by an offset read off the router logits, so XLA
    folds nothing; weights from the real router's softmax at those ids), one compilation a budget.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from ddtree_jax import bench as B
from ddtree_jax.compiled import routed_jit
from ddtree_jax.config import MOE
from ddtree_jax.models import moe as moe_model
from ddtree_jax.routes import REFERENCE
from ddtree_jax.speculative import generate as gen
from ddtree_jax.tree import root_path

EOS = jnp.zeros((0,), jnp.int32)


def is_moe(cfg) -> bool:
    return MOE in cfg.ffn_kinds


def expert_bytes(cfg) -> int:
    """Weight bytes of one routed expert of one layer (gate | up and down)."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    return 3 * h * i * jnp.dtype(cfg.dtype).itemsize


def unprobed_decode_bytes(cfg, dense_decode_bytes: int, batch: int) -> tuple[int, str]:
    """A decode step's bytes without a routing probe (plain decoding only): every layer's routed
    experts replaced by the ones a step reads - k at batch 1 (a top-k is k distinct experts), the
    expected distinct count under uniform routing, E (1 - (1 - k / E)^batch), at more rows (random
    weights route about uniformly). Returns the bytes and how they were counted."""
    e, k = cfg.moe_num_experts, cfg.moe_top_k
    layers = sum(kind == MOE for kind in cfg.ffn_kinds)
    distinct = float(k) if batch == 1 else e * (1 - (1 - k / e) ** batch)
    how = ("top-k experts a layer (batch 1)" if batch == 1
           else f"{distinct:.1f} expected distinct experts a layer (uniform routing)")
    return int(dense_decode_bytes - layers * (e - distinct) * expert_bytes(cfg)), how


def _moe_blocks(model) -> list:
    return [layer.mlp for layer in model.layers if isinstance(getattr(layer, "mlp", None), moe_model.SparseMoeBlock)]


def _wrap_route(block, route) -> None:
    """The block's routing replaced by `route(x, routes) -> (ids, weights)` (SparseMoeBlock.route's
    signature; this merged instance only)."""
    object.__setattr__(block, "route", route)


# ---- the routing probe ----------------------------------------------------------------------------
@routed_jit(static_argnames=("graphdef", "spec", "budgets"))
def _probe(graphdef, params, dparams, s, spec, budgets):
    """(trees of every budget, [(x, ids, weights)] of every MoE layer in the largest tree's verify)."""
    model = nnx.merge(graphdef, params)
    seen = []
    for block in _moe_blocks(model):
        def recording(x, routes=REFERENCE, original=block.route):
            ids, weights = original(x, routes)
            seen.append((x, ids, weights))
            return ids, weights

        _wrap_route(block, recording)
    logq = gen.propose(model, dparams, s, spec)
    ids = gen.vocab_ids(spec, dparams)
    trees = {b: gen.build(logq, s, dataclasses.replace(spec, budget=b), ids) for b in budgets}
    gen.verify(model, s, trees[max(budgets)], dataclasses.replace(spec, budget=max(budgets)))
    return trees, seen


def _paths(tree, row: int) -> dict[tuple, int]:
    """{token path from the root: node index} of a tree row's valid nodes (host)."""
    tokens, parents, valid = (np.asarray(a)[row] for a in (tree.tokens, tree.parents, tree.valid))
    return {tuple(int(tokens[j]) for j in root_path(parents, i)): i for i in range(len(tokens)) if valid[i]}


def node_rows(big, small) -> tuple[np.ndarray, int]:
    """For each row b and valid node of `small`, the flat verify row b * N_big + i of the same node
    (same token path) in `big`; and how many of small's valid nodes big lacks (0 when small's node set
    is a subset, as the DDTree top-B sets are)."""
    n_big = big.tokens.shape[1]
    rows, missing = [], 0
    for b in range(big.tokens.shape[0]):
        where = _paths(big, b)
        for path in _paths(small, b):
            if path in where:
                rows.append(b * n_big + where[path])
            else:
                missing += 1
    return np.asarray(rows, np.int64), missing


def distinct_per_layer(ids_by_layer, rows) -> list[int]:
    """Distinct experts chosen by `rows` in each layer (ids_by_layer: [T, k] host arrays)."""
    return [len(np.unique(ids[rows])) for ids in ids_by_layer]


def probe_routing(run_probe, params, dparams, state, budgets) -> dict:
    """Run the probe (module docstring; run_probe: its compiled program, `submit_programs`):
    {"decode": rows, b: rows for every budget}, the per-layer (x, ids, weights) of the largest
    verify (device), their ids on the host, and unmatched nodes."""
    budgets = tuple(sorted(budgets))
    trees, seen = run_probe(params, dparams, state)
    big = trees[budgets[-1]]
    n_big = big.tokens.shape[1]
    rows = {"decode": np.arange(big.tokens.shape[0]) * n_big}  # the roots: node 0 of each row
    missing = {}
    for b in budgets:
        rows[b], missing[b] = node_rows(big, trees[b])
    return {"rows": rows, "seen": seen, "ids": [np.asarray(ids) for _, ids, _ in seen], "missing": missing,
            "nodes": {b: trees[b].tokens.shape[1] for b in budgets}}


# ---- correlated stand-in routing ---------------------------------------------------------------------
def shared_of(top_k: int) -> int:
    """Experts a node of the correlated stand-in shares with the previous node: 3/4 of k (6 of 8)."""
    return (3 * top_k) // 4


@functools.lru_cache(maxsize=1024)
def correlated_ids(rows: int, nodes: int, top_k: int, experts: int, seed: int) -> np.ndarray:
    """[rows * nodes, k] int32 (cached: read only): each row's nodes a chain, every node sharing
    shared_of(k) experts with the node before and drawing the rest among the experts that node did
    not choose; rows independent; each node's k experts distinct (a top-k)."""
    rng = np.random.default_rng(seed)
    shared = max(shared_of(top_k), 2 * top_k - experts)  # the new ones must fit outside the previous node's
    every = np.arange(experts)
    out = np.empty((rows, nodes, top_k), np.int32)
    for r in range(rows):
        out[r, 0] = rng.choice(experts, top_k, replace=False)
        for i in range(1, nodes):
            keep = rng.choice(out[r, i - 1], shared, replace=False)
            new = rng.choice(np.setdiff1d(every, out[r, i - 1]), top_k - shared, replace=False)
            out[r, i] = rng.permutation(np.concatenate([keep, new]))
    out = out.reshape(rows * nodes, top_k)
    out.flags.writeable = False
    return out


@dataclasses.dataclass(frozen=True)
class StandIn:
    """The correlated stand-in router of a timed step: `nodes` rows of a tree per batch row."""

    nodes: int
    seed: int = 0

    def install(self, model) -> None:
        for layer, block in enumerate(_moe_blocks(model)):
            _wrap_route(block, functools.partial(self._route, block, self.seed + 1000 * layer))

    def _route(self, block, seed: int, x, routes=REFERENCE):
        t = x.shape[0]
        e, k = block.router.kernel.shape[1], block.top_k
        table = jnp.asarray(correlated_ids(max(1, t // self.nodes), self.nodes, k, e, seed)[:t])
        logits = block.router(x, routes)
        offset = jnp.argmax(logits[0]).astype(jnp.int32)  # traced: the table is not a constant
        ids = (table + offset) % e
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights = jnp.take_along_axis(probs, ids, axis=-1)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return ids, weights.astype(x.dtype).astype(jnp.float32)


@routed_jit(static_argnames=("graphdef", "spec", "stand_in"))
def _steps_with_stand_in(graphdef, params, dparams, s, n, spec, stand_in: StandIn):
    model = nnx.merge(graphdef, params)
    stand_in.install(model)
    return gen._advance(model, dparams, s, EOS, spec, n)


def time_correlated_steps(run_steps, params, dparams, state, loop_steps: int, repeats: int) -> float:
    """The DDTree step's marginal ms (n / 2n pairs) with the correlated stand-in router (run_steps:
    the compiled _steps_with_stand_in of that budget)."""
    call = lambda k: lambda: run_steps(params, dparams, state, jnp.int32(k))
    return B.paired_marginal_ms(call, loop_steps, repeats)[0]


# ---- the expert products alone -----------------------------------------------------------------------
@routed_jit(options_arg="routes", static_argnames=("routes",))
def _experts_loop(stacks, rows, n, routes):
    """n iterations of every MoE layer's expert product on its rows; the rows pass an optimization
    barrier with the loop index (nothing hoisted) and the outputs are carried (nothing dropped)."""
    def body(i, outs):
        rs = lax.optimization_barrier((rows, i))[0]
        return [moe_model.experts(x, ids, w, wi, wo, act=moe_model.SILU_GLU, routes=routes)
                for (x, ids, w), (wi, wo) in zip(rs, stacks)]

    return lax.fori_loop(0, n, body, [jnp.zeros_like(x) for x, _, _ in rows])


def expert_times(run_loop, stacks, rows, loop_iters: int, repeats: int) -> float:
    """Marginal ms of one pass over every MoE layer's expert product (n / 2n pairs; run_loop: the
    compiled _experts_loop for these rows' shapes)."""
    call = lambda k: lambda: run_loop(stacks, rows, jnp.int32(k))
    return B.paired_marginal_ms(call, loop_iters, repeats)[0]


def expert_stacks(params, cfg) -> list:
    """(gate_up_proj, down_proj) of every MoE layer, in layer order (device arrays)."""
    layers = params["layers"]
    return [(layers[i]["mlp"]["experts"]["gate_up_proj"][...], layers[i]["mlp"]["experts"]["down_proj"][...])
            for i, kind in enumerate(cfg.ffn_kinds) if kind == MOE]


# ---- one batch's figures -----------------------------------------------------------------------------
def submit_programs(pool, cfg, graphdef, params, dparams, state, spec, budgets, times: bool,
                    correlated_steps: bool) -> None:
    """Hand the batch's programs to a compile_pool.CompilePool: the probe ("moe_probe"), with
    correlated_steps every budget's step loop under the stand-in router ("moe_corr_B"), with times
    the expert-product loops, one per token count (decode: the batch; budget b: batch x (b + 1);
    "moe_experts_T")."""
    budgets = tuple(sorted(budgets))
    probe_spec = dataclasses.replace(spec, budget=budgets[-1])
    pool.submit("moe_probe", functools.partial(_probe.lower, graphdef, params, dparams, state, probe_spec, budgets))
    for b in budgets if correlated_steps else ():
        pool.submit(f"moe_corr_{b}", functools.partial(_steps_with_stand_in.lower, graphdef, params, dparams, state,
                                                        jnp.int32(1), dataclasses.replace(spec, budget=b),
                                                        StandIn(nodes=b + 1)))
    if not times:
        return
    stacks = expert_stacks(params, cfg)
    batch, h, k = state.bonus.shape[0], cfg.hidden_size, cfg.moe_top_k
    sds = jax.ShapeDtypeStruct
    for tokens in sorted({batch} | {batch * (b + 1) for b in budgets}):
        rows = [(sds((tokens, h), jnp.dtype(cfg.dtype)), sds((tokens, k), jnp.int32), sds((tokens, k), jnp.float32))
                for _ in stacks]
        pool.submit(f"moe_experts_{tokens}",
                    functools.partial(_experts_loop.lower, stacks, rows, jnp.int32(1), spec.routes))


def batch_figures(cfg, pool, params, dparams, state, budgets, *, step_ms: dict, dense_decode_bytes: int,
                  read_GBps: float, times: bool, loop_iters: int, repeats: int, correlated_steps: bool,
                  loop_steps: int, log=print) -> dict:
    """The MoE report of one batch (module docstring); pool: the CompilePool `submit_programs`
    handed this batch's programs to (with the same times / correlated_steps). step_ms: the e2e
    loop's marginal step times by choice ("ar", "16", ...); dense_decode_bytes: e2e.decode_bytes
    (every weight but the embedding table, K / V, state), from which the unchosen experts are
    taken out."""
    t0 = time.time()
    run_probe, _ = pool.get("moe_probe")
    probe = probe_routing(run_probe, params, dparams, state, budgets)
    ids, rows = probe["ids"], probe["rows"]
    ebytes = expert_bytes(cfg)
    layers = len(ids)
    e, k = cfg.moe_num_experts, cfg.moe_top_k
    decode = distinct_per_layer(ids, rows["decode"])
    out = {"layers": layers, "experts": e, "top_k": k, "correlated_shared": shared_of(k), "expert_bytes": ebytes,
           "probe_s": time.time() - t0,
           "unmatched_nodes": probe["missing"], "how": "routing probe of the largest budget's verify (module doc)"}
    out["decode"] = {"distinct_mean": statistics.mean(decode), "distinct_per_layer": decode,
                     "expert_GB": sum(decode) * ebytes / 1e9}
    out["decode_bytes"] = int(dense_decode_bytes - layers * e * ebytes + sum(decode) * ebytes)
    out["decode_roofline_ms"] = out["decode_bytes"] / (read_GBps * 1e6)
    stacks = expert_stacks(params, cfg) if times else None
    x_all = [x for x, _, _ in probe["seen"]]
    w_all = [w for _, _, w in probe["seen"]]
    batch = state.bonus.shape[0]

    def timed(rows_idx, corr_nodes=None):
        """(ms under the probe's routing, ms under the stand-in or None) of the expert products on
        these rows (the stand-in: the same rows and weights, its ids)."""
        sel = jnp.asarray(rows_idx)
        real = [(x[sel], jnp.asarray(i[rows_idx]), w[sel]) for x, i, w in zip(x_all, ids, w_all)]
        run_loop, _ = pool.get(f"moe_experts_{len(rows_idx)}")
        real_ms = expert_times(run_loop, stacks, real, loop_iters, repeats)
        if corr_nodes is None:
            return real_ms, None
        corr = [(x, jnp.asarray(correlated_ids(batch, corr_nodes, k, e, 1000 * layer)), w)
                for layer, (x, _, w) in enumerate(real)]
        return real_ms, expert_times(run_loop, stacks, corr, loop_iters, repeats)

    if times:
        real_ms, _ = timed(rows["decode"])
        out["decode"].update(experts_ms=real_ms, experts_roofline_ms=out["decode"]["expert_GB"] * 1e3 / read_GBps)
        out["decode"]["experts_x_roofline"] = real_ms / out["decode"]["experts_roofline_ms"]
    out["budgets"] = {}
    for b in sorted(budgets):
        nodes = probe["nodes"][b]
        dist = distinct_per_layer(ids, rows[b])
        corr = [len(np.unique(correlated_ids(batch, nodes, k, e, 1000 * layer))) for layer in range(layers)]
        fig = {"nodes": nodes, "tokens": batch * nodes, "distinct_mean": statistics.mean(dist),
               "distinct_per_layer": dist, "ratio_to_decode": statistics.mean(dist) / statistics.mean(decode),
               "expert_GB": sum(dist) * ebytes / 1e9, "correlated_distinct_mean": statistics.mean(corr),
               "correlated_ratio_to_decode": statistics.mean(corr) / statistics.mean(decode),
               "correlated_expert_GB": sum(corr) * ebytes / 1e9, "step_ms": step_ms.get(str(b))}
        if fig["step_ms"] is not None and step_ms.get("ar"):
            fig["step_over_decode"] = fig["step_ms"] / step_ms["ar"]
        if times and len(rows[b]) == batch * nodes:
            real_ms, corr_ms = timed(rows[b], nodes)
            roof = fig["expert_GB"] * 1e3 / read_GBps
            fig.update(experts_ms=real_ms, experts_roofline_ms=roof, experts_x_roofline=real_ms / roof,
                       correlated_experts_ms=corr_ms,
                       correlated_experts_x_roofline=corr_ms / (fig["correlated_expert_GB"] * 1e3 / read_GBps))
            if fig["step_ms"] is not None:
                fig["correlated_step_ms_estimate"] = fig["step_ms"] - real_ms + corr_ms
        if correlated_steps:
            fig["correlated_step_ms"] = time_correlated_steps(pool.get(f"moe_corr_{b}")[0], params, dparams, state,
                                                              loop_steps, repeats)
        out["budgets"][b] = fig
        log(f"[moe] budget {b}: {fig['distinct_mean']:.1f} distinct experts a layer ({fig['ratio_to_decode']:.1f}x "
            f"decode's {out['decode']['distinct_mean']:.1f}); correlated stand-in {fig['correlated_distinct_mean']:.1f}"
            + (f"; expert products {fig['experts_ms']:.2f} ms = {fig['experts_x_roofline']:.2f}x their bytes / read "
               f"rate (correlated {fig['correlated_experts_ms']:.2f} ms)" if "experts_ms" in fig else ""))
    out["seconds"] = time.time() - t0
    return out


def print_table(runs: list) -> None:
    """The MoE figures of every batch: the decode step against its roofline, then per budget the
    distinct experts, the step and the expert products against their bytes, random and correlated."""
    nan = float("nan")
    g = lambda d, key: nan if d.get(key) is None else d[key]
    print("\nMoE decode step (roofline: dense weights + chosen experts + K/V + state at the run's read rate)")
    print("batch  experts/layer  decode_ms  roofline_ms  %roofline  experts_ms  experts_x_roof")
    for r in runs:
        if "moe" not in r:
            continue
        d = r["moe"]["decode"]
        print(f"{r['batch']:5d}  {d['distinct_mean']:13.1f}  {g(r, 'ar_loop_step_ms'):9.2f}  "
              f"{r['moe']['decode_roofline_ms']:11.2f}  {100 * g(r, 'decode_fraction_of_roofline'):8.1f}%  "
              f"{g(d, 'experts_ms'):10.3f}  {g(d, 'experts_x_roofline'):14.2f}")
    print("\nDDTree steps (random = the random router; corr = the stand-in sharing 3/4 of a node's experts with "
          "the previous node; corr step: timed, else ~ the estimate)")
    print("batch budget  experts  x_decode  step_ms  /decode  experts_ms  x_roof | corr_experts  x_decode  "
          "corr_exp_ms  x_roof  corr_step_ms")
    for r in runs:
        for b, f in (r.get("moe") or {}).get("budgets", {}).items():
            corr = f.get("correlated_step_ms")
            corr_txt = f"{corr:12.2f}" if corr is not None else f"~{g(f, 'correlated_step_ms_estimate'):11.2f}"
            print(f"{r['batch']:5d} {int(b):6d}  {f['distinct_mean']:7.1f}  {f['ratio_to_decode']:8.1f}  "
                  f"{g(f, 'step_ms'):7.2f}  {g(f, 'step_over_decode'):7.2f}  {g(f, 'experts_ms'):10.3f}  "
                  f"{g(f, 'experts_x_roofline'):6.2f} | {f['correlated_distinct_mean']:12.1f}  "
                  f"{f['correlated_ratio_to_decode']:8.1f}  {g(f, 'correlated_experts_ms'):11.3f}  "
                  f"{g(f, 'correlated_experts_x_roofline'):6.2f}  {corr_txt}")
