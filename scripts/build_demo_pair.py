"""Build the demo pair end to end: corpus -> tokenizer -> target -> drafter -> export -> eval.

    python -m scripts.build_demo_pair --out "$OUT/demo"       # GPU, ~8.5 min
    python -m scripts.build_demo_pair --toy --out /tmp/toy    # CPU, tiny

Outputs (7 files, at most 2 levels below --out):
    target/config.json, target/model.safetensors, target/tokenizer.json   (HF qwen3_5_text)
    drafter/config.json, drafter/model.safetensors                        (z-lab DFlashDraftModel)
    corpus_manifest.json   every corpus file (path, size, sha256, split) + licences + corpus hash
    report.json            settings, versions, parameter counts, training curves, held-out
                           losses, and the speculative-decoding evaluation table
Everything is seeded. Training phases are time-budgeted (the step count follows the measured
step time); pass --target-steps / --drafter-steps for a fully deterministic run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from converters.dflash import load_drafter
from converters.load import load_target
from ddtree_jax import atomic
from ddtree_jax.config import TargetConfig
from ddtree_jax.drafter_config import DrafterConfig, validate_against_target
from ddtree_jax.speculative.dflash import DFlashProposer
from ddtree_jax.speculative.generate import generate
from ddtree_jax.training import corpus as corpus_mod
from ddtree_jax.training import tokenizer as tok_mod
from ddtree_jax.training.drafter_trainer import (DEMO_DRAFTER_SHAPE, TOY_DRAFTER_SHAPE, DrafterSettings,
                                                 drafter_hf_config, train_drafter)
from ddtree_jax.training.export import export_drafter, export_target
from ddtree_jax.training.target_trainer import (DEMO_TARGET_SHAPE, TOY_TARGET_SHAPE, TrainSettings, cast_tree,
                                                count_params, target_hf_config, train_target)

T_START = time.time()  # reset by main(): the deadline counts from the run, not the import
EXPORT_DTYPE = "bfloat16"


def log(msg: str) -> None:
    print(f"[{time.time() - T_START:7.1f}s] {msg}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_out = os.path.join(os.environ["OUT"], "demo") if os.environ.get("OUT") else "demo_pair"
    p.add_argument("--out", default=default_out, help="output directory (default: $OUT/demo, else ./demo_pair)")
    p.add_argument("--toy", action="store_true", help="tiny everything (CPU, well under 2 minutes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-minutes", type=float, default=4.0, help="target phase budget incl. compile")
    p.add_argument("--drafter-minutes", type=float, default=3.0, help="drafter phase budget incl. compile")
    p.add_argument("--total-minutes", type=float, default=8.75,
                   help="hard budget of the whole run; the drafter phase shrinks to keep the eval inside it")
    p.add_argument("--target-steps", type=int, default=None, help="fixed target steps (deterministic)")
    p.add_argument("--drafter-steps", type=int, default=None, help="fixed drafter steps (deterministic)")
    p.add_argument("--corpus-mb", type=float, default=None, help="corpus size cap in MiB (default 48; toy 0.25)")
    p.add_argument("--vocab", type=int, default=None, help="tokenizer vocabulary (default 8192; toy 512)")
    p.add_argument("--compute-dtype", default=None, help="training compute dtype (default bfloat16; toy float32)")
    p.add_argument("--eval-dtype", default="float32", help="params dtype for the generation eval")
    p.add_argument("--budgets", default=None, help="DDTree budgets, comma separated (default 16,32,64,128,256)")
    p.add_argument("--prompts", type=int, default=None, help="held-out prompts (default 8)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128)")
    p.add_argument("--max-new", type=int, default=None, help="generated tokens per prompt (default 128)")
    return p.parse_args(argv)


def settings_for(args):
    if args.toy:
        d = dict(corpus_mb=0.25, include_packages=False, heldout_fraction=0.1, tokenizer_mb=0.25, vocab=512,
                 compute_dtype="float32", target_shape=TOY_TARGET_SHAPE, drafter_shape=TOY_DRAFTER_SHAPE,
                 budgets=(16,), linear=False, prompts=2, prompt_len=32, max_new=24, eval_reserve_s=0.0)
        tset = TrainSettings(seq_len=64, batch_size=8, peak_lr=5e-3, warmup_steps=3, max_steps=args.target_steps or 20,
                             log_every=10, eval_windows=8, seed=args.seed, seconds=1e9, reserve_seconds=0.0)
        dset = DrafterSettings(seq_len=64, batch_size=8, anchors_per_seq=8, peak_lr=5e-3, warmup_steps=3,
                               max_steps=args.drafter_steps or 20, log_every=10, eval_windows=8,
                               seed=args.seed, seconds=1e9, reserve_seconds=0.0)
    else:
        d = dict(corpus_mb=48.0, include_packages=True, heldout_fraction=0.02, tokenizer_mb=12.0, vocab=8192,
                 compute_dtype="bfloat16", target_shape=DEMO_TARGET_SHAPE, drafter_shape=DEMO_DRAFTER_SHAPE,
                 budgets=(16, 32, 64, 128, 256), linear=True, prompts=8, prompt_len=128, max_new=128,
                 eval_reserve_s=75.0)
        tset = TrainSettings(seq_len=512, batch_size=64, peak_lr=3e-3, warmup_steps=100, max_steps=args.target_steps,
                             log_every=100, eval_windows=128, seed=args.seed, seconds=args.target_minutes * 60,
                             reserve_seconds=15.0)
        dset = DrafterSettings(seq_len=512, batch_size=32, anchors_per_seq=128, peak_lr=3e-3, warmup_steps=100,
                               max_steps=args.drafter_steps, log_every=100, eval_windows=64, seed=args.seed,
                               seconds=args.drafter_minutes * 60, reserve_seconds=12.0)
    for key in ("corpus_mb", "vocab", "compute_dtype", "prompts", "prompt_len", "max_new"):
        value = getattr(args, key)
        if value is not None:
            d[key] = value
    if args.budgets:
        d["budgets"] = tuple(int(b) for b in args.budgets.split(","))
    tset = dataclasses.replace(tset, compute_dtype=d["compute_dtype"])
    dset = dataclasses.replace(dset, compute_dtype=d["compute_dtype"])
    return d, tset, dset


def select_prompts(heldout_tokens, eos_id: int, n: int, length: int):
    """n prompts of `length` tokens from held-out documents (the middle of each), deterministic."""
    cuts = np.flatnonzero(heldout_tokens == eos_id)
    starts = np.concatenate([[0], cuts[:-1] + 1]) if len(cuts) else np.array([0])
    docs = [heldout_tokens[s:e] for s, e in zip(starts, cuts)] if len(cuts) else [heldout_tokens]
    docs = [d for d in docs if len(d) >= length + 16]
    picks = []
    if docs:
        for i in np.linspace(0, len(docs) - 1, min(n, len(docs))).round().astype(int):
            doc = docs[i]
            mid = max(length, len(doc) // 2)
            picks.append(doc[mid - length:mid])
    stream = heldout_tokens
    k = 0
    while len(picks) < n:  # not enough long documents: evenly spaced windows of the stream
        span = max(1, len(stream) - length)
        start = (k * 7919) % span
        picks.append(stream[start:start + length])
        k += 1
    return np.stack(picks).astype(np.int32)


def precision_ctx():
    """Full float32 matmuls for the eval (no TF32 on GPU), so greedy outputs are comparable."""
    ctx = getattr(jax, "default_matmul_precision", None)
    return ctx("highest") if ctx is not None else contextlib.nullcontext()


def evaluate(out_dir: str, prompts, budgets, max_new: int, dtype: str, deadline: float, linear: bool = True):
    """Greedy generation with the EXPORTED pair: AR, DFlash linear, DDTree per budget.

    The first call of every mode (compile + run) runs in a thread pool, so the XLA compiles
    overlap; then each mode is timed once more, one after the other.
    """
    cfg, graphdef, params = load_target(os.path.join(out_dir, "target"), dtype=dtype)
    dcfg, dgraph, dparams = load_drafter(os.path.join(out_dir, "drafter"), dtype=dtype)
    validate_against_target(dcfg, cfg)
    proposer = DFlashProposer(dgraph, dcfg)
    prompt = jnp.asarray(prompts)
    lens = jnp.full((prompt.shape[0],), prompt.shape[1], jnp.int32)
    runs = [("ar", "ar", 0)] + ([("dflash", "dflash", 0)] if linear else [])
    runs += [(f"ddtree_{b}", "ddtree", b) for b in budgets]

    def call(mode, budget):
        kw = dict(mode=mode, max_new_tokens=max_new)
        if mode != "ar":
            kw.update(proposer=proposer, drafter_params=dparams)
        if mode == "ddtree":
            kw.update(budget=budget)
        t0 = time.time()
        with precision_ctx():  # thread-local: entered in the calling thread
            res = generate(graphdef, params, prompt, lens, **kw)
            jax.block_until_ready(res.tokens)
        return res, time.time() - t0

    t_warm = time.time()
    warm = {}
    # Parallel compiles on accelerators only: on a CPU backend the runs would execute side by side
    # too, and jaxlib 0.10's CPU LAPACK kernels can deadlock when several run at once.
    workers = len(runs) if jax.default_backend() != "cpu" else 1
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {name: pool.submit(call, mode, budget) for name, mode, budget in runs}
        for name, fut in futures.items():
            try:
                warm[name] = fut.result()
            except Exception as e:  # noqa: BLE001 - keep the other modes' results
                warm[name] = e
                log(f"[eval] {name} failed: {e!r}")
    log(f"[eval] compiled and ran {len(runs)} modes in {time.time() - t_warm:.1f} s ({workers} thread(s))")
    ref = np.asarray(warm["ar"][0].tokens) if not isinstance(warm.get("ar"), Exception) else None
    rows = {}
    for name, mode, budget in runs:
        if isinstance(warm[name], Exception):
            rows[name] = {"mode": mode, "budget": budget or None, "skipped": f"error: {warm[name]!r}"[:300]}
            continue
        res, first_s = warm[name]
        seconds = None
        if time.time() < deadline - 5:  # a compiled run takes about a second
            _, seconds = call(mode, budget)  # timed run (compiled)
        else:
            log(f"[eval] {name}: no time left for a timed run (no tokens/s)")
        tokens = np.asarray(res.tokens)
        n_tok = np.asarray(res.num_tokens)
        steps = np.asarray(res.steps)
        emitted = int(np.sum(n_tok - 1))  # tokens after the prefill's own
        row = {
            "mode": mode,
            "budget": budget or None,
            "acceptance_length": emitted / max(1, int(np.sum(steps))),
            "per_prompt_acceptance": [round(float(e) / max(1, int(st)), 3) for e, st in zip(n_tok - 1, steps)],
            "steps": int(np.sum(steps)),
            "tokens": int(np.sum(n_tok)),
            "seconds": None if seconds is None else round(seconds, 4),
            "tokens_per_s": None if seconds is None else float(np.sum(n_tok)) / max(seconds, 1e-9),
            "compile_and_first_run_s": round(first_s, 2),
            "matches_ar": float(np.mean(np.all(tokens == ref, axis=1))) if ref is not None else None,
            "accepted_hist": np.asarray(res.accepted_hist).tolist(),
        }
        rows[name] = row
        tps = "-" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:.1f}"
        log(f"[eval] {name:>11}: tau {row['acceptance_length']:.3f}  {tps:>8} tok/s  "
            f"matches AR {row['matches_ar']}  (compile+first run {first_s:.1f} s)")
    ar = rows.get("ar", {})
    for row in rows.values():
        if row.get("tokens_per_s") and ar.get("tokens_per_s"):
            row["speedup_vs_ar"] = row["tokens_per_s"] / ar["tokens_per_s"]
    return rows, {"target_dtype": cfg.dtype, "drafter_dtype": dcfg.dtype, "batch": int(prompt.shape[0]),
                  "prompt_len": int(prompt.shape[1]), "max_new_tokens": max_new, "greedy": True,
                  "tokens_per_s": "all prompts' tokens (prefill token included) / wall time of one batched call"}


def format_table(rows: dict) -> str:
    lines = [f"{'mode':>12} {'budget':>6} {'tau':>6} {'tok/s':>9} {'x AR':>6} {'=AR':>5}"]
    for name, r in rows.items():
        if "skipped" in r:
            lines.append(f"{name:>12} {'':>6} skipped ({r['skipped']})")
            continue
        same = "-" if r["matches_ar"] is None else f"{r['matches_ar']:.2f}"
        tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f}"
        speed = "-" if "speedup_vs_ar" not in r else f"{r['speedup_vs_ar']:.2f}"
        lines.append(f"{r['mode']:>12} {str(r['budget'] or '-'):>6} {r['acceptance_length']:6.3f} "
                     f"{tps:>9} {speed:>6} {same:>5}")
    return "\n".join(lines)


def write_json(path: str, obj) -> None:
    atomic.write_json(path, obj, indent=1, default=str)


def main(argv=None) -> int:
    global T_START
    args = parse_args(argv)
    T_START = time.time()
    deadline = T_START + args.total_minutes * 60
    if args.toy:
        jax.config.update("jax_default_matmul_precision", "highest")
    d, tset, dset = settings_for(args)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    report_path = os.path.join(out, "report.json")
    versions = {"python": platform.python_version(), "jax": jax.__version__}
    for mod in ("jaxlib", "flax", "optax", "tokenizers", "numpy", "safetensors"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - reporting only
            versions[mod] = None
    report = {
        "command": " ".join(["python -m scripts.build_demo_pair", *(sys.argv[1:] if argv is None else argv)]),
        "toy": args.toy, "seed": args.seed, "versions": versions,
        "devices": [str(x) for x in jax.devices()], "settings": {k: v for k, v in d.items()},
        "timings_s": {},
    }
    log(f"devices {report['devices']}; jax {jax.__version__}; out {out}")

    # 1. corpus
    t = time.time()
    corpus = corpus_mod.gather_corpus(int(d["corpus_mb"] * (1 << 20)), heldout_fraction=d["heldout_fraction"],
                                      include_packages=d["include_packages"])
    manifest = corpus.manifest()
    write_json(os.path.join(out, "corpus_manifest.json"), manifest)
    used = [s for s in manifest["sources"] if s.get("files_used")]
    log(f"corpus: {manifest['totals']} from {len(used)} sources, sha256 {manifest['corpus_sha256'][:16]}")
    report["corpus"] = {"sha256": manifest["corpus_sha256"], "totals": manifest["totals"],
                        "sources_used": [{k: s[k] for k in ("name", "version", "license", "files_used", "bytes_used")}
                                         for s in used]}
    report["timings_s"]["corpus"] = round(time.time() - t, 2)

    # 2. tokenizer (trained on a content-hash-ordered subset of the training files)
    t = time.time()
    train_files = corpus.split("train")
    heldout_files = corpus.split("heldout")
    budget, tok_texts = int(d["tokenizer_mb"] * (1 << 20)), []
    for f in sorted(train_files, key=lambda f: f.sha256):
        if budget <= 0:
            break
        tok_texts.append(f.text)
        budget -= f.size
    tokenizer = tok_mod.train_tokenizer(tok_texts, d["vocab"])
    ids = tok_mod.special_ids(tokenizer)
    train_tokens = tok_mod.encode_documents(tokenizer, [f.text for f in train_files])
    heldout_tokens = tok_mod.encode_documents(tokenizer, [f.text for f in heldout_files])
    report["tokenizer"] = {"vocab_size": tokenizer.get_vocab_size(), "special_ids": ids,
                           "trained_on_bytes": sum(len(x.encode()) for x in tok_texts),
                           "train_tokens": int(len(train_tokens)), "heldout_tokens": int(len(heldout_tokens)),
                           "bytes_per_token": manifest["totals"]["train"]["bytes"] / max(1, len(train_tokens))}
    report["timings_s"]["tokenizer"] = round(time.time() - t, 2)
    log(f"tokenizer: vocab {tokenizer.get_vocab_size()}, {len(train_tokens):,} train / {len(heldout_tokens):,} "
        f"held-out tokens ({report['tokenizer']['bytes_per_token']:.2f} bytes/token)")
    write_json(report_path, report)

    # 3. target
    t = time.time()
    thf = target_hf_config(tokenizer.get_vocab_size(), ids["eos"], **d["target_shape"])
    tcfg = TargetConfig.from_hf_dict(thf)
    tgraph, tparams, thist = train_target(tcfg, train_tokens, heldout_tokens, tset, log=log)
    report["target"] = {"config": thf, "params": count_params(tparams), "training": thist,
                        "epochs": thist["tokens_seen"] / max(1, len(train_tokens))}
    files = export_target(os.path.join(out, "target"), thf, tparams, tokenizer=tokenizer, dtype=EXPORT_DTYPE)
    report["target"]["files"] = files
    report["timings_s"]["target"] = round(time.time() - t, 2)
    write_json(report_path, report)

    # 4. drafter, against the target exactly as exported (bf16-rounded weights)
    t = time.time()
    dhf = drafter_hf_config(tcfg, ids["mask"], block_size=16, **d["drafter_shape"])
    dcfg = DrafterConfig.from_hf_dict(dhf)
    validate_against_target(dcfg, tcfg)
    if dset.max_steps is None:
        room = deadline - time.time() - d["eval_reserve_s"]
        seconds = min(dset.seconds, room)
        if seconds < dset.seconds:
            log(f"drafter budget cut to {seconds:.0f} s to keep the evaluation inside --total-minutes")
        dset = dataclasses.replace(dset, seconds=max(seconds, 30.0))
    exported = cast_tree(cast_tree(tparams, EXPORT_DTYPE), "float32")  # exactly the weights written
    dgraph, dparams, dhist = train_drafter(dcfg, tcfg, tgraph, exported, train_tokens, heldout_tokens, dset, log=log)
    files = export_drafter(os.path.join(out, "drafter"), dhf, dparams, dtype=EXPORT_DTYPE)
    report["drafter"] = {"config": dhf, "params": count_params(dparams), "training": dhist, "files": files}
    report["timings_s"]["drafter"] = round(time.time() - t, 2)
    write_json(report_path, report)
    del tparams, dparams, exported

    # 5. evaluation of the exported pair
    t = time.time()
    prompts = select_prompts(heldout_tokens, ids["eos"], d["prompts"], d["prompt_len"])
    if not args.toy and time.time() > deadline - 20:  # the toy run always evaluates (tests read it)
        rows, meta = {}, {"skipped": "no time left in --total-minutes"}
    else:
        try:
            rows, meta = evaluate(out, prompts, d["budgets"], d["max_new"], args.eval_dtype,
                                  deadline if not args.toy else float("inf"), linear=d["linear"])
        except Exception as e:  # noqa: BLE001 - the exported pair stays; the report says why
            if args.toy:
                raise
            log(f"[eval] failed: {e!r}")
            rows, meta = {}, {"error": repr(e)[:1000]}
    report["eval"] = {"setup": meta, "results": rows}
    report["timings_s"]["eval"] = round(time.time() - t, 2)
    report["timings_s"]["total"] = round(time.time() - T_START, 2)
    write_json(report_path, report)
    table = format_table(rows)
    print(table, flush=True)
    sizes = {os.path.relpath(os.path.join(dp, f), out): os.path.getsize(os.path.join(dp, f))
             for dp, _, fs in os.walk(out) for f in fs}
    log(f"wrote {len(sizes)} files, {sum(sizes.values()) / 1e6:.2f} MB: "
        + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sorted(sizes.items())))
    log(f"target {report['target']['params']:,} params, held-out loss {thist['heldout_loss']:.4f}; "
        f"drafter {report['drafter']['params']:,} params, tau proxy {dhist['heldout']['tau_proxy']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
