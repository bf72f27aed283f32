"""Load test of ddtree-serve: N concurrent streaming clients on localhost, per mode.

For each mode it starts `ddtree-serve` (python -m ddtree_jax.cli.serve; --url uses a running
server instead), then for each client count runs that many clients, each sending its share of a
fixed request list (prompts and lengths drawn once from --seed) one after another, streamed.
Bounded: --requests per level and --duration seconds per level, localhost only. Reported per
mode and client count: output throughput (completion tokens / wall time), time to first token,
inter-token latency (each streamed chunk's gap since the previous chunk, spread over the tokens
it carried: one sample per token) and time per output token of each request, p50 / p99; JSON and
a plot (matplotlib, imported only to draw).

--static-batch B: after the servers, the same request list of the level with B clients goes
through Engine.generate in fixed batches of B (each batch runs to its longest request) in this
process, all requests known in advance and no HTTP: the device's bound for static batches.
--served-static adds, per mode, a server with `--batching static` (requests join only when every
slot is free) run at B clients: static batching behind the same HTTP server and streaming, the
like-for-like comparison the server exists for (docs/serving.md).

--budget auto (the default) serves mode ddtree with the adaptive budget (its step-time tables
measured at the server's start-up; --cost-table FILE loads them, for the ddtree server only) and runs
the static engine with it too (its own table per batch, measured untimed); the report holds the
steps of each choice per level (the server's ddtree_auto_steps_total) and per static run.

    python -m scripts.load_test --modes ar,dflash,ddtree --clients 1,8,32 --static-batch 32 \
        --out $OUT/load.json
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ddtree_jax.atomic import write_bytes, write_json  # noqa: E402
from ddtree_jax.cli.common import budget_arg  # noqa: E402

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
DEFAULT_PROMPTS = os.path.join(ROOT, "docs", "demo_heldout_prompts.jsonl")


def _httpx():
    """httpx2 (what openai >= 3 uses), else httpx: the same API."""
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx
    return httpx


# ---- the request list -------------------------------------------------------------------------
def load_prompts(path: str) -> list[list[int]]:
    """Token-id prompts from a JSONL file of {"prompt_ids": [...]} (or {"prompt": [...]})."""
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                out.append([int(t) for t in d.get("prompt_ids", d.get("prompt"))])
    if not out:
        raise ValueError(f"no prompts in {path}")
    return out


def request_list(prompts, n: int, seed: int, prompt_len: tuple[int, int], max_tokens: tuple[int, int]):
    """n requests: a prompt cut to a random length in prompt_len, a max_tokens in max_tokens."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        p = prompts[i % len(prompts)]
        length = int(rng.integers(min(prompt_len[0], len(p)), min(prompt_len[1], len(p)) + 1))
        reqs.append({"prompt": p[:length], "max_tokens": int(rng.integers(max_tokens[0], max_tokens[1] + 1))})
    return reqs


# ---- clients ----------------------------------------------------------------------------------
async def one_request(http, url: str, model: str, req: dict, temperature: float) -> dict:
    body = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": temperature,
            "stream": True, "return_token_ids": True, "seed": 0}
    t0 = time.perf_counter()
    arrivals = []  # (time, tokens in the chunk)
    finish = None
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                return {"error": d["error"]["message"]}
            choice = d["choices"][0]
            n = len(choice.get("token_ids") or [])
            if n:
                arrivals.append((time.perf_counter(), n))
            finish = choice.get("finish_reason") or finish
    t1 = time.perf_counter()
    tokens = sum(n for _, n in arrivals)
    itl = []
    for (ta, _), (tb, n) in zip(arrivals, arrivals[1:]):
        itl += [(tb - ta) / n] * n
    ttft = arrivals[0][0] - t0 if arrivals else None
    return {"tokens": tokens, "ttft": ttft, "itl": itl, "seconds": t1 - t0, "finish": finish,
            "tpot": (t1 - t0 - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None}


async def run_level(url: str, model: str, requests: list[dict], clients: int, duration: float,
                    temperature: float = 0.0) -> dict:
    """`clients` concurrent clients through `requests` (client c takes requests c, c + clients, ...),
    stopping new requests after `duration` seconds."""
    httpx = _httpx()
    check_local(url)
    deadline = time.perf_counter() + duration
    results = []

    async def client(c: int, http):
        for req in requests[c::clients]:
            if time.perf_counter() >= deadline:
                return
            results.append(await one_request(http, url, model, req, temperature))

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c, http) for c in range(clients)))
        wall = time.perf_counter() - t0
    return summarize(results, wall, clients)


def pct(values, q) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) * 1000 if values else None


def summarize(results: list[dict], wall: float, clients: int) -> dict:
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    itl = [x for r in ok for x in r["itl"]]
    return {
        "clients": clients, "requests": len(ok), "errors": [r["error"] for r in results if "error" in r][:5],
        "error_count": len(results) - len(ok), "completion_tokens": tokens, "seconds": wall,
        "throughput_tok_s": tokens / wall if wall > 0 else None, "requests_per_s": len(ok) / wall if wall else None,
        "ttft_ms": {"p50": pct([r["ttft"] for r in ok], 50), "p99": pct([r["ttft"] for r in ok], 99)},
        "itl_ms": {"p50": pct(itl, 50), "p99": pct(itl, 99)},
        "tpot_ms": {"p50": pct([r["tpot"] for r in ok], 50), "p99": pct([r["tpot"] for r in ok], 99)},
    }


def auto_steps(url: str) -> dict[str, float]:
    """The server's steps per budget-auto choice so far (ddtree_auto_steps_total; empty without auto)."""
    text = _httpx().get(url + "/metrics", timeout=10).text
    return {c: float(v) for c, v in re.findall(r'^ddtree_auto_steps_total\{choice="([^"]+)"\} (\S+)$', text, re.M)}


def check_local(url: str) -> None:
    host = urllib.parse.urlparse(url).hostname
    if host not in LOCAL_HOSTS:
        raise ValueError(f"the load test only targets this machine (127.0.0.1 / localhost), not {host!r}")


# ---- servers ----------------------------------------------------------------------------------
class LaunchedServer:
    """ddtree-serve in a subprocess for one mode; SIGTERM at the end."""

    def __init__(self, mode: str, port: int, max_batch: int, extra: list[str], log_path: str):
        cmd = [sys.executable, "-m", "ddtree_jax.cli.serve", "--mode", mode, "--port", str(port), "--max-batch",
               str(max_batch), "--log-level", "warning"] + extra
        self.log = open(log_path, "w")
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float) -> None:
        httpx = _httpx()
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ddtree-serve exited with {self.proc.returncode} (log: {self.log.name})")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"ddtree-serve did not come up in {timeout} s (log: {self.log.name})")

    def stop(self, grace: float = 120.0) -> int:
        """SIGTERM, then SIGKILL after `grace` seconds (in-flight requests finish meanwhile)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


# ---- the static-batch engine --------------------------------------------------------------------
def static_batches(engine, requests: list[dict], batch: int, mode: str, budget: int | str) -> dict:
    """The requests through Engine.generate in fixed batches of `batch` (in order): each batch runs
    until its longest request ends; generation time only (the engine compiles, and under budget
    "auto" measures its step-time table, untimed)."""
    tokens, seconds, choices = 0, 0.0, {}
    for i in range(0, len(requests), batch):
        part = requests[i : i + batch]
        res = engine.generate([r["prompt"] for r in part], mode=mode, budget=budget,
                              max_new_tokens=[r["max_tokens"] for r in part])
        tokens += sum(c.stats.num_tokens for c in res)
        seconds += res[0].stats.seconds
        for name, n in ((res[0].stats.adaptive or {}).get("choices") or {}).items():
            choices[name] = choices.get(name, 0) + n
    row = {"batch": batch, "requests": len(requests), "completion_tokens": tokens, "seconds": seconds,
           "throughput_tok_s": tokens / seconds if seconds else None}
    return row | ({"auto_steps": choices} if choices else {})


# ---- report ------------------------------------------------------------------------------------
def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for mode, runs in report["levels"].items():
        xs = [r["clients"] for r in runs]
        axes[0].plot(xs, [r["throughput_tok_s"] for r in runs], "o-", label=mode)
        axes[1].plot(xs, [r["ttft_ms"]["p50"] for r in runs], "o-", label=f"{mode} p50")
        axes[1].plot(xs, [r["ttft_ms"]["p99"] for r in runs], "x--", label=f"{mode} p99")
        axes[2].plot(xs, [r["itl_ms"]["p50"] for r in runs], "o-", label=f"{mode} p50")
        axes[2].plot(xs, [r["itl_ms"]["p99"] for r in runs], "x--", label=f"{mode} p99")
    for s in report.get("static", []):
        axes[0].scatter([s["batch"]], [s["throughput_tok_s"]], marker="s", label=f"static {s['mode']}")
    for ax, title, unit in zip(axes, ("output throughput", "time to first token", "inter-token latency"),
                               ("tokens / s", "ms", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle(f"ddtree-serve load test ({report['device']})")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_bytes(path, buf.getvalue())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="ar,dflash,ddtree", help="modes to serve, one server each")
    p.add_argument("--clients", default="1,8,32", help="concurrent client counts")
    p.add_argument("--requests", type=int, default=64, help="requests per level (at least the client count)")
    p.add_argument("--duration", type=float, default=300.0, help="seconds per level before clients stop sending")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help="JSONL of {prompt_ids: [...]}")
    p.add_argument("--prompt-len", default="16,128", help="prompt lengths drawn from MIN,MAX tokens")
    p.add_argument("--max-tokens", default="32,256", help="max_tokens drawn from MIN,MAX")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", default=None, help="a running server (localhost) instead of launching one per mode")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--budget", type=budget_arg, default="auto",
                   help="DDTree budget of the servers and the static engine: nodes per step, or auto (default)")
    p.add_argument("--cost-table", default=None, metavar="FILE",
                   help="the ddtree server's step-time tables under --budget auto (ddtree-serve --cost-table; "
                        "the ar and dflash servers take none); default: measured at its start-up")
    p.add_argument("--server-args", default="", help="more ddtree-serve arguments, e.g. '--max-context 1024'")
    p.add_argument("--start-timeout", type=float, default=1800.0, help="seconds a server may take to compile")
    p.add_argument("--static-batch", type=int, default=0, help="also run the static-batch engine at this batch")
    p.add_argument("--served-static", action="store_true",
                   help="with --static-batch B: also serve each mode with --batching static (requests join only "
                   "when every slot is free) and run its level of B clients: static batching behind the same HTTP "
                   "server, the like-for-like comparison")
    p.add_argument("--target", default=None, help="the static engine's target (default: the demo pair)")
    p.add_argument("--drafter", default=None)
    p.add_argument("--out", default="load_test.json", help="JSON report; the plot goes beside it (.png)")
    return p


def server_arguments(mode: str, args, levels, max_prompt: int, max_tokens: int) -> list[str]:
    """ddtree-serve's arguments for one mode's server: batch buckets at the client counts, room for
    the longest request, prefills warmed up to the longest prompt, the cost table for the ddtree
    server under budget auto; --server-args last (they override these)."""
    extra = ["--budget", str(args.budget), "--batch-buckets", ",".join(map(str, levels)),
             "--max-context", str(max_prompt + max_tokens), "--warmup-prompt-len", str(max_prompt)]
    if args.cost_table and mode == "ddtree" and args.budget == "auto":
        extra += ["--cost-table", args.cost_table]
    return extra + args.server_args.split()


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (e.g. from `timeout`) unwinds like an exit, so the finally blocks stop the servers
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    modes = [m for m in args.modes.split(",") if m]
    levels = sorted({int(c) for c in args.clients.split(",")})
    lo_p, hi_p = (int(x) for x in args.prompt_len.split(","))
    lo_t, hi_t = (int(x) for x in args.max_tokens.split(","))
    if args.cost_table and ("ddtree" not in modes or args.budget != "auto" or args.url):
        p.error("--cost-table applies to the ddtree server this tool starts, under --budget auto")
    if args.cost_table and not os.path.isfile(args.cost_table):
        p.error(f"--cost-table {args.cost_table}: no such file")
    if args.served_static and (not args.static_batch or args.url):
        p.error("--served-static needs --static-batch B (its client count) and servers this tool starts")
    if args.served_static and args.static_batch not in {int(c) for c in args.clients.split(",")}:
        p.error(f"--served-static: --static-batch {args.static_batch} must be one of --clients {args.clients} "
                "(the continuous level it is compared with)")
    if args.served_static and "--batching" in args.server_args.split():
        p.error("--served-static sets --batching itself: leave it out of --server-args")
    if args.url:
        check_local(args.url)
        if len(modes) != 1:
            p.error("--url serves one mode: give it with --modes")
    prompts = load_prompts(args.prompts)
    report = {"device": None, "args": vars(args), "levels": {}, "static": []}
    lists = {c: request_list(prompts, max(args.requests, c), args.seed, (lo_p, hi_p), (lo_t, hi_t)) for c in levels}

    def save():
        write_json(args.out, report)

    runs = [(mode, "continuous", levels) for mode in modes]
    if args.served_static:  # the like-for-like baseline: the same server, requests join only an empty batch
        runs += [(mode, "static", [args.static_batch]) for mode in modes]
    for mode, batching, run_levels in runs:
        server = None
        key = mode if batching == "continuous" else f"{mode}/served-static"
        if args.url:
            url = args.url
        else:
            extra = server_arguments(mode, args, levels, hi_p, hi_t) + (
                ["--batching", "static"] if batching == "static" else [])
            log = os.path.splitext(args.out)[0] + f"_{key.replace('/', '_')}.log"
            server = LaunchedServer(mode, args.port, max(levels), extra, log)
            try:
                server.wait_ready(args.start_timeout)
            except BaseException:  # never leave a server behind (it holds the accelerator's memory)
                server.stop(grace=5)
                raise
            url = server.url
        try:
            httpx = _httpx()
            model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            report["device"] = httpx.get(url + "/health", timeout=10).json().get("device")
            report["levels"][key] = []
            for c in run_levels:
                before = auto_steps(url)
                row = asyncio.run(run_level(url, model, lists[c], c, args.duration, args.temperature))
                row["mode"], row["batching"] = mode, batching
                after = auto_steps(url)
                if after:  # budget auto: the steps of each choice at this level
                    row["auto_steps"] = {k: v - before.get(k, 0.0) for k, v in after.items()}
                if batching == "static":
                    cont = next((r for r in report["levels"].get(mode, []) if r["clients"] == c), None)
                    if cont is not None:
                        row["continuous_over_served_static"] = cont["throughput_tok_s"] / row["throughput_tok_s"]
                report["levels"][key].append(row)
                print(f"[load] {key} {c:3d} clients: {row['throughput_tok_s']:.1f} tok/s, ttft p50 "
                      f"{row['ttft_ms']['p50']:.1f} ms p99 {row['ttft_ms']['p99']:.1f}, itl p50 "
                      f"{row['itl_ms']['p50']:.2f} ms p99 {row['itl_ms']['p99']:.2f}, {row['error_count']} errors"
                      + (f", steps {row['auto_steps']}" if row.get("auto_steps") else ""), flush=True)
                save()
        finally:
            if server is not None:
                code = server.stop()
                report.setdefault("server_exit", {})[key] = code
    if args.static_batch:
        import jax

        from ddtree_jax.demo import demo_paths
        from ddtree_jax.engine import Engine

        target, drafter = (args.target, args.drafter) if args.target else demo_paths()
        engine = Engine.load(target, drafter)
        report["device"] = report["device"] or str(jax.devices()[0].device_kind)
        reqs = lists.get(args.static_batch) or request_list(prompts, max(args.requests, args.static_batch), args.seed,
                                                            (lo_p, hi_p), (lo_t, hi_t))
        for mode in modes:
            row = static_batches(engine, reqs, args.static_batch, mode, args.budget)
            row["mode"] = mode
            cont = next((r for r in report["levels"].get(mode, []) if r["clients"] == args.static_batch), None)
            if cont is not None:
                row["continuous_throughput_tok_s"] = cont["throughput_tok_s"]
                row["continuous_over_static"] = cont["throughput_tok_s"] / row["throughput_tok_s"]
            report["static"].append(row)
            print(f"[load] static {mode} batch {args.static_batch}: {row['throughput_tok_s']:.1f} tok/s"
                  + (f" (continuous: {row['continuous_over_static']:.2f}x)" if cont else "")
                  + (f", steps {row['auto_steps']}" if row.get("auto_steps") else ""), flush=True)
            save()
    save()
    plot(report, os.path.splitext(args.out)[0] + ".png")
    print(f"[load] wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
