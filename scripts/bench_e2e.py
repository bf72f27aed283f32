"""End-to-end step benchmark at real model size (run on the H200; random weights, on device).

Target: Qwen3.6-27B-shaped hybrid (hidden 5120, 64 layers, full attention every 4th, 24 q / 4 kv
heads of 256, GDN 16 k / 48 v heads of 128, conv 4, FFN 17408, vocab 248320, bf16) and a 5-layer
DFlash drafter of the same width. The caches are filled with random K/V and recurrent states at
a 4k context (no 4k prefill to compile), then we time, by the median of repeats:
  - the plain decode step (one token per sequence), against the HBM roofline: bytes that must
    be read per step (weights, KV, recurrent + conv state) / the best read rate measured in the
    same run (a large bf16 reduction and a large bf16 GEMV);
  - one DDTree step (draft + tree build + verify + commit) at budget 64, whole and by phase;
  - N and 2N steps inside one on-device while_loop (no host sync per step): the step is the
    marginal cost (T(2N) - T(N)) / N, the median over back-to-back (N, 2N) pairs (since session
    13; before, the difference of the two medians), net of the per-call host dispatch (a ~1000-leaf params
    pytree: several ms a call on the H200, paid once per generation chunk, not per step), which is
    reported beside it, as is T(N) / N, the per-step figure of sessions 1-7 that carried 1/N of it;
  - batch 1 and 8; peak device memory;
  - with --budgets B1,B2,... (and dflash in --modes) the loop step of DFlash and of every budget too:
    each run's `step_ms_by_choice` ({"ar", "dflash", "B"...: ms}) is a step-time table for the
    adaptive budget's simulation (scripts/adaptive_bench.py simulate; one file per --context).
Writes JSON (--out) and prints a table last.

    PYTHONPATH=. python3 scripts/bench_e2e.py --out $OUT/e2e.json           # on the H200
    PYTHONPATH=. python3 scripts/bench_e2e.py --smoke                       # tiny shapes, any device
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax import atomic
from ddtree_jax import autotune_cache, overrides
from ddtree_jax.bench import median_ms, paired_marginal_ms
from ddtree_jax.cache import KVCache, RecurrentCache, TargetCache
from ddtree_jax.config import TargetConfig
from ddtree_jax.drafter_config import DrafterConfig
from ddtree_jax.models import int8
from ddtree_jax.models.drafter import DrafterCache, DrafterModel
from ddtree_jax.models.target import TargetModel
from ddtree_jax.speculative import generate as gen
from ddtree_jax.speculative.dflash import DFlashProposer
from ddtree_jax.speculative.sampling import Sampling

QWEN36_27B = dict(
    model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
    num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    rms_norm_eps=1e-6, tie_word_embeddings=False, dtype="bfloat16", max_position_embeddings=262144,
)
SMOKE = dict(QWEN36_27B, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)


def drafter_config(tcfg: TargetConfig, layers: int, heads: int, kv: int, head_dim: int, block: int) -> DrafterConfig:
    return DrafterConfig.from_hf_dict({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": tcfg.hidden_size,
        "intermediate_size": tcfg.intermediate_size, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "rope_theta": 1e7, "rms_norm_eps": 1e-6,
        "vocab_size": tcfg.vocab_size, "num_target_layers": tcfg.num_layers, "block_size": block, "dtype": "bfloat16",
        "dflash_config": {"mask_token_id": tcfg.vocab_size - 1},
    })


def random_params(abstract, seed: int):
    """Random bf16 weights created on device leaf by leaf (std ~ fan_in^-1/2; norms ~0/1)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    leaves = []
    for i, (path, leaf) in enumerate(flat):
        name = jax.tree_util.keystr(path)
        key = jax.random.PRNGKey(seed * 100003 + i)
        shape, dtype = leaf.shape, leaf.dtype
        if "A_log" in name or "dt_bias" in name:
            leaves.append(jax.random.uniform(key, shape, jnp.float32, -1, 1).astype(dtype))
        elif "norm" in name:
            leaves.append((1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dtype))
        else:
            std = (shape[0] if len(shape) == 2 and "embedding" not in name else 1) ** -0.5
            leaves.append(_normal(key, shape, dtype, std))
    return jax.tree_util.tree_unflatten(treedef, leaves)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _normal(key, shape, dtype, std):
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)


def filled_caches(cfg: TargetConfig, dcfg: DrafterConfig, batch: int, context: int, capacity: int, seed: int):
    """Target and drafter caches holding `context` committed tokens of random state per row
    (batch > 1: lengths spread over [context/2, context])."""
    key = jax.random.PRNGKey(seed)
    lengths = jnp.asarray(np.linspace(context, context // 2, batch).astype(np.int32)) if batch > 1 else jnp.asarray([context], jnp.int32)
    layers = []
    for i, kind in enumerate(cfg.layer_types):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        if kind == "attention":
            shape = (batch, cfg.num_kv_heads, capacity, cfg.head_dim)
            layers.append(KVCache(_normal(k1, shape, jnp.bfloat16, 1.0), _normal(k2, shape, jnp.bfloat16, 1.0)))
        else:
            layers.append(RecurrentCache(
                _normal(k1, (batch, cfg.conv_kernel - 1, cfg.gdn_conv_dim), jnp.bfloat16, 1.0),
                _normal(k2, (batch, cfg.gdn_num_v_heads, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim), jnp.float32, 0.05)))
    dlayers = []
    for i in range(dcfg.num_layers):
        k1, k2 = jax.random.split(jax.random.fold_in(key, 1000 + i))
        shape = (batch, dcfg.num_kv_heads, capacity, dcfg.head_dim)
        dlayers.append(KVCache(_normal(k1, shape, jnp.bfloat16, 1.0), _normal(k2, shape, jnp.bfloat16, 1.0)))
    return TargetCache(tuple(layers), lengths), DrafterCache(tuple(dlayers), lengths)


def add_drafter_options(ap) -> None:
    """The drafter variants bench_e2e.py and profile_step.py can time (`drafter_setup`)."""
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="draft from ids 0..N-1 only (ddtree_jax/speculative/draft_vocab.py; 0 = the whole vocabulary)")
    ap.add_argument("--int8-drafter", action="store_true",
                    help="the drafter and its draft head with int8 weights (ddtree_jax/models/int8.py)")


def drafter_setup(proposer, dparams, graphdef, params, args):
    """(proposer, drafter params) as `add_drafter_options` asked: ids 0..n-1 (`--draft-vocab n`),
    int8 weights (`--int8-drafter`), or as given."""
    if not (args.draft_vocab or args.int8_drafter):
        return proposer, dparams
    target = nnx.merge(graphdef, params)
    if args.draft_vocab:
        from ddtree_jax.speculative.draft_vocab import first_ids

        proposer, dparams = proposer.with_draft_vocab(dparams, target, first_ids(args.draft_vocab,
                                                                                 target.cfg.vocab_size))
    if args.int8_drafter:
        proposer, dparams = proposer.with_int8(dparams, target)
    return proposer, dparams


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def measure_bandwidth(smoke: bool) -> dict:
    """Best read rate of the device (scripts/gpu_bench_common.jax_rates: a bf16 reduction and a bf16
    GEMV over 2 GiB, tiny with --smoke), under this report's keys."""
    from scripts.gpu_bench_common import jax_rates

    rates = jax_rates(not smoke, False, matmul=False)
    return {"reduce_GBps": rates["reduction_GBps"], "gemv_GBps": rates["gemv_GBps"], "best_GBps": rates["hbm_GBps"]}


def decode_bytes(cfg: TargetConfig, params, cache: TargetCache) -> int:
    """Bytes a decode step must read: every weight but the embedding table (one row), the K/V up to
    each row's length, and the recurrent + conv state (read and written)."""
    weights = nbytes(params) - cfg.vocab_size * cfg.hidden_size * 2 * (0 if cfg.tie_word_embeddings else 1)
    lengths = np.asarray(cache.lengths)
    kv = sum(2 * int(lengths.sum()) * layer.k.shape[1] * layer.k.shape[3] * layer.k.dtype.itemsize
             for layer in cache.layers if isinstance(layer, KVCache))
    rec = sum(2 * (nbytes(layer.state) + nbytes(layer.conv)) for layer in cache.layers if isinstance(layer, RecurrentCache))
    return int(weights + kv + rec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU or GPU) to check the script")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--modes", default="ar,ddtree", help="'ar' alone times plain decoding only (no DDTree, no phases); "
                    "add dflash to time the DFlash chain's step")
    ap.add_argument("--budgets", default="", help="more DDTree budgets whose loop step is timed (step_ms_by_choice)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--loop-steps", type=int, default=16)
    ap.add_argument("--no-phases", action="store_true",
                    help="skip batch 1's phase split (four more compilations): more step samples a GPU call")
    ap.add_argument("--phase-inner", type=int, default=32,
                    help="iterations of each phase per timed call (the phase split is the difference of "
                         "calls of N and 2N iterations; at 8 the 27B commit phase drowned in dispatch jitter)")
    add_drafter_options(ap)
    ap.add_argument("--kernels", default=None,
                    help="tree kernels for the DDTree step: xla | pallas | pallas_interpret (default: fastest for the backend)")
    overrides.add_argument(ap)
    autotune_cache.add_argument(ap)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "e2e.json"))
    args = ap.parse_args(argv)
    # before the backend starts (the first device use): XLA reads its flags then
    cache_dir = autotune_cache.use_autotune_cache(args.autotune_cache) if args.autotune_cache else None
    applied = overrides.apply_from_args(ap, args)

    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["scripts/bench_e2e.py"] + (argv if argv is not None else sys.argv[1:])),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__, "overrides": applied,
              "autotune_cache": cache_dir, "runs": []}

    def save():
        atomic.write_json(args.out, report)

    raw = SMOKE if args.smoke else QWEN36_27B
    cfg = TargetConfig.from_hf_dict(raw)
    context = 64 if args.smoke else args.context
    dcfg = drafter_config(cfg, 5, 4 if args.smoke else 32, 2 if args.smoke else 8, 32 if args.smoke else 128, 16)
    print(f"[bench] device {report['device']}, jax {jax.__version__}", flush=True)
    cache_dir = os.environ.get("JAX_CACHE_DIR")
    if cache_dir:  # persistent compilation cache: a second call on a warm machine skips compiles
        jax.config.update("jax_compilation_cache_dir", cache_dir)
    report["bandwidth"] = measure_bandwidth(args.smoke)
    print(f"[bench] HBM read rate: {report['bandwidth']['best_GBps']:.0f} GB/s", flush=True)
    save()

    t0 = time.time()
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: TargetModel(cfg, rngs=nnx.Rngs(0))))
    params = random_params(abstract, 0)
    dgraph, dabstract = nnx.split(nnx.eval_shape(lambda: DrafterModel(dcfg, rngs=nnx.Rngs(0))))
    dparams = random_params(dabstract, 1)
    jax.block_until_ready((params, dparams))
    report["target_params_GB"] = nbytes(params) / 1e9
    report["drafter_params_GB"] = nbytes(dparams) / 1e9
    print(f"[bench] weights on device in {time.time() - t0:.1f} s: target {report['target_params_GB']:.1f} GB, "
          f"drafter {report['drafter_params_GB']:.2f} GB", flush=True)
    proposer, dparams = drafter_setup(DFlashProposer(dgraph, dcfg), dparams, graphdef, params, args)
    report["draft_vocab"] = args.draft_vocab or None
    report["int8_drafter"] = args.int8_drafter
    report["int8_scheme"] = int8.scheme() if args.int8_drafter else None
    if args.int8_drafter:
        report["drafter_params_GB"] = nbytes(dparams) / 1e9  # int8 layers + the int8 draft head
        print(f"[bench] int8 drafter: {report['drafter_params_GB']:.2f} GB with its draft head", flush=True)
    kernels = args.kernels or gen.default_kernels()
    report["kernels"] = kernels
    print(f"[bench] tree kernels: {kernels}", flush=True)
    eos = jnp.zeros((0,), jnp.int32)
    key = jax.random.PRNGKey(0)

    @functools.partial(jax.jit, static_argnames=("spec",))
    def n_steps(params, dparams, s, n, spec):
        return gen._advance(nnx.merge(graphdef, params), dparams, s, eos, spec, n)

    for batch in [int(b) for b in args.batches.split(",")]:
        capacity = context + 64
        cache, dcache = filled_caches(cfg, dcfg, batch, context, capacity, seed=batch)
        row = {"batch": batch, "context": context, "lengths": np.asarray(cache.lengths).tolist()}
        max_new = 10**6
        state = gen.LoopState(cache, dcache, jnp.zeros((batch,), jnp.int32) + 7, jnp.zeros((batch, 8), jnp.int32),
                              jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool), jnp.zeros((batch,), jnp.int32),
                              jnp.zeros((17,), jnp.int32), jnp.int32(0), key)
        modes = [m for m in ("ar", "ddtree") if m in args.modes.split(",")]
        # (key, mode, budget): ar and ddtree at --budget keep their keys; DFlash and --budgets add runs
        extra = [("dflash", "dflash", args.budget)] if "dflash" in args.modes.split(",") else []
        extra += [(f"ddtree{b}", "ddtree", int(b)) for b in args.budgets.split(",") if b and int(b) != args.budget]
        row["step_ms_by_choice"] = {}
        for key_, mode, budget in [(m, m, args.budget) for m in modes] + extra:
            spec = gen.GenSpec(mode, budget, None, max_new, Sampling(), capacity, None if mode == "ar" else proposer,
                               kernels)
            s = state if mode != "ar" else state._replace(dstate=None, hist=jnp.zeros((2,), jnp.int32))
            # One compiled on-device loop per mode; the step count is traced, so a single step and
            # a run of n steps share the compilation.
            t_c = time.time()
            ms = median_ms(lambda: n_steps(params, dparams, s, jnp.int32(1), spec), args.repeats)
            row[f"{key_}_step_ms"] = ms
            row[f"{key_}_compile_and_warm_s"] = time.time() - t_c
            n = args.loop_steps
            reps = max(5, args.repeats)
            per, fixed, pairs = paired_marginal_ms(lambda k: lambda: n_steps(params, dparams, s, jnp.int32(k), spec),
                                                   n, reps)
            row[f"{key_}_loop_step_ms"] = per  # marginal: what one more step costs (median of paired runs)
            row[f"{key_}_loop_step_pairs_ms"] = pairs
            row[f"{key_}_dispatch_ms"] = fixed
            row[f"{key_}_loop_incl_dispatch_ms"] = per + fixed / n  # T(n) / n: sessions 1-7's "in-loop" figure
            print(f"[bench] batch {batch} {key_}: {ms:.2f} ms/step (single call), {row[f'{key_}_loop_step_ms']:.2f} "
                  f"ms/step in the on-device loop ({n} -> {2 * n} steps), {row[f'{key_}_loop_incl_dispatch_ms']:.2f} ms/step over {n} steps with "
                  f"the call's dispatch ({row[f'{key_}_dispatch_ms']:.2f} ms a call)", flush=True)
            row["step_ms_by_choice"]["ar" if mode == "ar" else "dflash" if mode == "dflash" else str(budget)] = per
            save()
        bytes_ = decode_bytes(cfg, params, cache)
        row["decode_bytes"] = bytes_
        row["roofline_ms"] = bytes_ / (report["bandwidth"]["best_GBps"] * 1e6)
        # Per-step figures from inside the on-device loop (what generation runs); single-call
        # figures add the host dispatch of a ~1000-leaf params pytree and are reported beside them.
        row["decode_fraction_of_roofline"] = row["roofline_ms"] / row["ar_loop_step_ms"]
        row["decode_fraction_of_roofline_incl_dispatch"] = row["roofline_ms"] / row["ar_loop_incl_dispatch_ms"]
        row["ddtree_over_decode"] = (row["ddtree_loop_step_ms"] / row["ar_loop_step_ms"]
                                     if "ddtree" in modes else None)
        # Phase split of the DDTree step (batch 1 only, unless --no-phases: four more compilations).
        from ddtree_jax import bench as B

        if (batch != 1 and not args.smoke) or "ddtree" not in modes or args.no_phases:
            row["phases_ms"] = None
            stats = jax.local_devices()[0].memory_stats() or {}
            row["peak_memory_GB"] = stats.get("peak_bytes_in_use", 0) / 1e9 or None
            report["runs"].append(row)
            save()
            del cache, dcache, state
            continue

        spec = gen.GenSpec("ddtree", args.budget, None, max_new, Sampling(), capacity, proposer, kernels)
        inner = 2 if args.smoke else args.phase_inner
        row["phases_ms"] = B.phase_times_at(graphdef, params, dparams, state, spec, key, repeats=args.repeats,
                                            inner=inner)
        row["phase_inner"] = inner
        row["phases_sum_ms"] = sum(row["phases_ms"].values())  # against ddtree_loop_step_ms: the split's check
        print(f"[bench] batch {batch} ddtree phases (ms, in-loop): {row['phases_ms']}", flush=True)
        stats = jax.local_devices()[0].memory_stats() or {}
        row["peak_memory_GB"] = stats.get("peak_bytes_in_use", 0) / 1e9 or None
        report["runs"].append(row)
        save()
        del cache, dcache, state

    print("\n(decode / ddtree: marginal in-loop step; /16: T(16) / 16 with the call's dispatch, the older figure)")
    print("batch  decode_ms  roofline_ms  %roofline  ddtree_ms  ratio  decode/16  %roof/16  1call_ar  1call_tree  draft  build  verify  commit  peakGB")
    for r in report["runs"]:
        p = r["phases_ms"] or dict.fromkeys(("draft", "build", "verify", "commit"), float("nan"))
        nan = float("nan")
        print(f"{r['batch']:5d}  {r['ar_loop_step_ms']:9.2f}  {r['roofline_ms']:11.2f}  {100 * r['decode_fraction_of_roofline']:8.1f}%"
              f"  {r.get('ddtree_loop_step_ms', nan):9.2f}  {r['ddtree_over_decode'] or nan:5.2f}"
              f"  {r['ar_loop_incl_dispatch_ms']:9.2f}  {100 * r['decode_fraction_of_roofline_incl_dispatch']:7.1f}%  {r['ar_step_ms']:8.2f}  "
              f"{r.get('ddtree_step_ms', nan):10.2f}  {p['draft']:5.2f}  {p['build']:5.2f}  {p['verify']:6.2f}  "
              f"{p['commit']:6.2f}  {r['peak_memory_GB'] or float('nan'):6.1f}")
    print(f"HBM read rate {report['bandwidth']['best_GBps']:.0f} GB/s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
