"""ddtree-serve: an OpenAI-compatible HTTP server with continuous batching over the speculative loop."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from ddtree_jax.cli.common import (add_autotune_cache_argument, add_decoding_arguments, add_draft_vocab_argument,
                                   add_int8_drafter_argument, add_routes_arguments, die, non_negative_int, positive_int,
                                   routes_from, set_prog, use_autotune_cache)

EPILOG = """\
examples:
  ddtree-serve                                            # the embedded demo pair on 127.0.0.1:8000
  ddtree-serve --target ckpt/qwen35 --drafter ckpt/qwen35-dflash --max-batch 16 --max-context 8192
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "def fib(n):", "max_tokens": 64, "temperature": 0}'

Endpoints: POST /v1/completions, POST /v1/chat/completions (needs the model's chat template),
GET /v1/models, GET /health, GET /metrics (Prometheus). Requests share B slots on the device; a
request waits in a bounded queue for a free slot (429 when the queue is full). SIGTERM stops
accepting, lets running requests finish for --shutdown-timeout seconds, cancels the rest and
exits 0. Design: docs/serving.md.

--budget auto (the default): every device step picks plain decoding, DFlash or a tree of one of
--auto-budgets for the most tokens per second over the batch, from the drafter's confidence and a
step-time table per batch bucket: --cost-table FILE (ddtree-bench --batch B --cost-table FILE
writes one per batch; every bucket needs one) or measured at start-up (logged with its source).
/metrics counts the steps of each choice (ddtree_auto_steps_total{choice=...}).
"""


def build_parser() -> argparse.ArgumentParser:
    from ddtree_jax.demo import DEMO_DIR

    p = argparse.ArgumentParser(prog="ddtree-serve", description="Serve a target (+ DFlash drafter) over the OpenAI "
                                "API with continuous batching and speculative decoding.", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("models")
    src.add_argument("--target", default=None, help=f"target model directory with its tokenizer.json (default: the "
                     f"embedded demo pair in {DEMO_DIR})")
    src.add_argument("--drafter", default=None, help="DFlash drafter directory (default: the demo drafter when "
                     "--target is not given; none otherwise, which allows only --mode ar)")
    src.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="params dtype (default: the "
                     "checkpoint's; the demo pair runs in fp32 on a CPU)")
    src.add_argument("--model-name", default=None, help="the model id clients send (default: the target "
                     "directory's name, 'ddtree-demo' for the demo pair)")
    add_routes_arguments(src)
    add_autotune_cache_argument(src)
    dec = p.add_argument_group("decoding")
    add_decoding_arguments(dec, "--budget auto: step times from this file, a table for every batch bucket "
                              "(ddtree-bench --batch B --cost-table FILE writes them; default: measured at start-up)",
                           decide_every=False)
    dec.add_argument("--decide-every", type=non_negative_int, default=0, metavar="N",
                     help="--budget auto: 0 (default) chooses every step; N > 1 once per chunk of N steps on device "
                     "(the chosen draft's steps then cost what a fixed budget's do; a chunk goes on across the "
                     "server's chunks of --chunk-steps; decision 0046)")
    add_draft_vocab_argument(dec)
    add_int8_drafter_argument(dec)
    dec.add_argument("--max-top-k", type=non_negative_int, default=64,
                     help="the largest top_k a request may ask for (compiled in; default 64, 0 = no top-k)")
    dec.add_argument("--max-stop-ids", type=non_negative_int, default=8,
                     help="stop_token_ids a request may give (default 8)")
    srv = p.add_argument_group("serving")
    srv.add_argument("--max-batch", type=positive_int, default=8, help="slots: requests generated at once (default 8)")
    srv.add_argument("--max-context", type=positive_int, default=None,
                     help="prompt + generated tokens of one request (default: the model's limit, at most 4096); "
                     "every slot holds caches this long")
    srv.add_argument("--max-queue", type=positive_int, default=64,
                     help="requests that may wait for a slot; more get 429 (default 64)")
    srv.add_argument("--chunk-steps", type=positive_int, default=4,
                     help="device steps between two scheduling points (default 4): new requests join and tokens "
                     "stream after each chunk")
    srv.add_argument("--batch-buckets", type=_int_list, default=None, metavar="B1,B2,...",
                     help="batch sizes a chunk may run, one compilation each: the smallest holding the active "
                     "requests runs, so idle slots cost nothing (default: powers of two up to --max-batch)")
    srv.add_argument("--max-prefill", type=positive_int, default=None, metavar="N",
                     help="requests prefilled in one call (default: --max-batch): those waiting at a scheduling "
                     "point are prefilled together, their count padded to a power of two up to N (one compilation "
                     "per such count and prompt bucket)")
    srv.add_argument("--prefill-tokens", type=positive_int, default=None, metavar="N",
                     help="padded prompt tokens (requests x prompt bucket) one prefill call may take (default 2048 "
                     "on a GPU, 512 on a CPU): waiting requests are grouped by length into calls within it; "
                     "smaller helps time to first token where prefill is compute-bound (large models, CPU)")
    srv.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                     help="dispatch the next chunk before streaming the last one's tokens, so the device does not "
                     "wait for the host (costs each request a chunk of slot time); auto: on for a GPU, off on a "
                     "CPU, whose cores run both (default auto)")
    srv.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                     help="continuous (default): requests join free slots between chunks; static: the baseline - "
                     "requests join only when every slot is free, each batch runs to its longest request")
    srv.add_argument("--no-compact", action="store_true",
                     help="always run all --max-batch rows (one batch size, one compilation)")
    srv.add_argument("--no-warmup", action="store_true",
                     help="compile lazily (default: compile every prompt-length bucket and batch size first)")
    srv.add_argument("--warmup-prompt-len", type=positive_int, default=None, metavar="N",
                     help="warm up the prefill of prompt buckets up to N tokens only (longer prompts compile "
                     "on first use; default: all up to --max-context)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    srv.add_argument("--port", type=non_negative_int, default=8000, help="port (default 8000)")
    srv.add_argument("--shutdown-timeout", type=non_negative_int, default=30,
                     help="seconds running requests may finish after SIGTERM before they are cancelled (default 30)")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    srv.add_argument("--access-log", action="store_true", help="log every HTTP request")
    return p


def describe_budget(slots) -> str:
    """The budget part of the start-up line: ", budget 64", ", budget auto (...)" or nothing."""
    if slots.spec.mode != "ddtree":
        return ""
    if slots.auto is None:
        return f", budget {slots.spec.budget}"
    return (f", budget auto (plain, DFlash, budgets {','.join(map(str, slots.auto.budgets))}; objective "
            f"{slots.auto.objective}; chosen {slots.auto.form.replace('per step', 'every step')})")


def describe_table(table) -> str:
    """One line: each choice's step time at the table's first context, and where the table came from."""
    times = ", ".join(f"{'plain' if k == 'ar' else k} {v[0]:.3g} ms" for k, v in table.ms.items())
    return f"{times} (at {table.contexts[0]:.0f} tokens; {table.source})"


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _stop_quietly(signum, frame):  # noqa: ARG001
    raise SystemExit(0)


def _draining_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server; its first exit signal also starts the scheduler's drain."""

        def __init__(self, config, scheduler, grace_s: float):
            super().__init__(config)
            self.scheduler, self.grace_s = scheduler, grace_s

        def handle_exit(self, sig, frame):
            if not self.should_exit:
                self.scheduler.drain(self.grace_s)
            super().handle_exit(sig, frame)

    return DrainingServer


def main(argv=None) -> int:
    # SIGTERM while loading or compiling: exit 0 without serving (uvicorn takes it over later).
    signal.signal(signal.SIGTERM, _stop_quietly)
    set_prog("ddtree-serve")
    args = build_parser().parse_args(argv)
    from ddtree_jax.serve import missing_dependencies

    missing = missing_dependencies()
    if missing:
        die(f"ddtree-serve needs {', '.join(missing)}: install the serve extra, pip install 'ddtree-jax[serve]'")
    if args.port > 65535:
        die(f"--port must be in [0, 65535], got {args.port}")
    if args.max_prefill is not None and args.max_prefill > args.max_batch:
        die(f"--max-prefill ({args.max_prefill}) cannot exceed --max-batch ({args.max_batch})")
    if args.budget != "auto" or args.mode in ("ar", "dflash"):
        given = [flag for flag, v in (("--auto-budgets", args.auto_budgets), ("--cost-table", args.cost_table)) if v]
        if given:
            die(f"{' and '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to --mode ddtree --budget auto only")
    use_autotune_cache(args)
    routes = routes_from(args)

    import uvicorn

    from ddtree_jax.cli.common import load_engine
    from ddtree_jax.serve.app import create_app
    from ddtree_jax.serve.chat import load_chat_template
    from ddtree_jax.serve.metrics import Metrics
    from ddtree_jax.serve.protocol import Limits
    from ddtree_jax.serve.scheduler import Scheduler
    from ddtree_jax.serve.slots import SlotBatch

    engine = load_engine(args.target, args.drafter, args.dtype, routes=routes, draft_vocab=args.draft_vocab,
                         int8_drafter=args.int8_drafter)
    if engine.tokenizer is None:
        die("the target directory has no tokenizer.json: ddtree-serve needs one")
    target_dir = args.target
    if target_dir is None:
        from ddtree_jax.demo import demo_paths

        target_dir = demo_paths()[0]
    name = args.model_name or ("ddtree-demo" if args.target is None else os.path.basename(os.path.normpath(target_dir)))
    mode = args.mode or ("ddtree" if engine.proposer is not None else "ar")
    if args.cost_table and mode != "ddtree":
        die(f"--cost-table applies to --mode ddtree --budget auto only (the mode is {mode}: no drafter)")
    if args.decide_every and (mode != "ddtree" or args.budget != "auto"):
        die(f"--decide-every applies to --mode ddtree --budget auto only (here: mode {mode}, budget {args.budget})")
    max_context = args.max_context or min(engine.max_context, 4096)
    try:
        template = load_chat_template(target_dir)
        slots = SlotBatch(engine, mode=mode, budget=args.budget, max_batch=args.max_batch, max_context=max_context,
                          max_top_k=args.max_top_k, max_stop_ids=args.max_stop_ids, chunk_steps=args.chunk_steps,
                          buckets=(args.max_batch,) if args.no_compact else args.batch_buckets,
                          max_prefill=args.max_prefill, prefill_tokens=args.prefill_tokens,
                          auto_budgets=args.auto_budgets, cost_table=args.cost_table,
                          decide_every=args.decide_every)
    except ValueError as e:  # a bad --cost-table among them: named before anything compiles or listens
        die(str(e))
    budget = describe_budget(slots)
    import jax

    # auto: as SlotBatch resolves its CPU / accelerator defaults (prefill_tokens)
    overlap = args.overlap == "on" or (args.overlap == "auto" and jax.default_backend() != "cpu")
    print(f"ddtree-serve: {name}, mode {mode}{budget}, {args.max_batch} slots of {max_context} tokens, prefill "
          f"calls of up to {slots.max_prefill} requests / {slots.prefill_tokens} tokens, chunks "
          f"{'overlapped with' if overlap else 'then'} streaming, {args.batching} batching, "
          f"{'no' if template is None else 'a'} chat template", file=sys.stderr, flush=True)
    if not args.no_warmup:
        print(f"ddtree-serve: compiling (prompt buckets {slots.prompt_buckets}, prefill batches "
              f"{slots.prefill_buckets}, batch buckets {slots.buckets})"
              + (", then timing every choice per batch bucket" if slots.auto and len(slots.tables) < len(slots.buckets)
                 else ""), file=sys.stderr, flush=True)
        slots.warm_up(args.warmup_prompt_len)
    elif slots.auto is not None and len(slots.tables) < len(slots.buckets):
        print(f"ddtree-serve: compiling batch buckets {slots.buckets} and timing every choice (--budget auto without "
              "--cost-table)", file=sys.stderr, flush=True)
        slots.measure_costs()
    for rows, table in sorted(slots.tables.items()):
        print(f"ddtree-serve: step times, batch {rows}: {describe_table(table)}", file=sys.stderr, flush=True)
    metrics = Metrics(args.max_batch, mode, slots.choice_names)
    scheduler = Scheduler(slots, engine.tokenizer, max_queue=args.max_queue, metrics=metrics, overlap=overlap,
                          batching=args.batching)
    limits = Limits(name, max_context, engine.cfg.vocab_size, args.max_top_k, args.max_stop_ids)
    info = {"model": name, "mode": mode, "budget": args.budget if mode == "ddtree" else None,
            "slots": args.max_batch, "max_context": max_context, "device": jax.devices()[0].device_kind,
            "batching": args.batching, "overlap": overlap, "prefill_tokens": slots.prefill_tokens,
            "max_prefill": slots.max_prefill}
    if slots.auto is not None:
        info |= {"auto_budgets": list(slots.auto.budgets), "auto_objective": slots.auto.objective,
                 "cost_tables": {str(rows): t.source for rows, t in sorted(slots.tables.items())}}
    app = create_app(scheduler, limits, engine.tokenizer, template, metrics, info)
    # Past --shutdown-timeout the scheduler cancels what is left, which ends those responses
    # properly (an error event and [DONE]); uvicorn's own limit is a backstop behind it.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.access_log, timeout_graceful_shutdown=args.shutdown_timeout + 10,
                            lifespan="on")
    server = _draining_server_class()(config, scheduler, args.shutdown_timeout)
    # uvicorn handles SIGINT / SIGTERM while it runs (stop listening, let requests finish, then the
    # app's shutdown cancels what is left) and raises the signal again after restoring these
    # handlers: they must not end the process with the signal's status.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    server.run()
    if scheduler.error is not None:
        print(f"ddtree-serve: the scheduler failed: {scheduler.error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
