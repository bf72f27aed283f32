"""ddtree-serve live: the real `openai` client against the server in a subprocess (the demo pair,
with a chat template added in a fixture copy of its target).

The server runs --budget auto (its step times from a --cost-table file). Completion, chat
completion and streaming; 16 concurrent requests of different prompts, lengths and temperatures,
each greedy one token-identical to the same request decoded alone by Engine.generate's plain
decoding (greedy output does not depend on the budget's choices), or parted from it only at a
near tie of the target's top two logits (a token a plain step and a tree verify compute in
different passes, whose fp32 rounding may flip it: bench.top2_gap, the check ddtree-bench and
ddtree-generate --compare-ar make); a client that disconnects mid-stream frees its
slot; a full queue is a 429 with Retry-After and every bad input a 400 with an OpenAI error; the
choices in /metrics; a bad --cost-table ends the command before it serves; SIGTERM ends the server
with status 0.
"""

import asyncio
import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
try:
    import httpx2 as httpx  # the client openai >= 3 is built on
except ImportError:
    httpx = pytest.importorskip("httpx")

# one worker runs the whole module under pytest -n (one server, started once)
pytestmark = pytest.mark.xdist_group("serve-live")

from ddtree_jax import bench  # noqa: E402
from ddtree_jax.demo import demo_paths  # noqa: E402
from ddtree_jax.engine import Engine  # noqa: E402
from ddtree_jax.speculative import cost_table  # noqa: E402

MODE, BUDGET, MAX_CONTEXT, SLOTS, QUEUE = "ddtree", 16, 128, 4, 16  # BUDGET: the static engine's (the server's: auto)
AUTO_BUDGETS = (4, 16)
# step times (ms) the server's policy works with: plain steps cheapest; a draft predicted to accept
# 0.08 tokens a row wins (ar_margin 0.3), so the demo drafter drafts whatever the requests' arrival
# order. With a 2.3 ms DDTree-16, near the demo's break-even, a loaded CI machine's first drafts
# predicted too little, the policy ran plain steps (2 drafts in 186 row-steps) and the acceptance
# checks below saw no accepted token.
TABLE_MS = {"ar": 1.0, "dflash": 1.2, "4": 1.3, "16": 1.4}
CHAT_TEMPLATE = "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
NAME = "demo-chat"
PROMPTS = ["def fib(n):", "import os\n", "class Stack:", "for i in range(", "x = [1, 2,", "def add(a, b):",
           "# sort a list", "while True:"]
START_TIMEOUT = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat_model(directory) -> str:
    """The demo target with a chat template (the demo itself has none)."""
    target, _ = demo_paths()
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(target):
        os.symlink(os.path.join(target, name), os.path.join(directory, name))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": "<|endoftext|>"}, f)
    return str(directory)


def write_table(engine, path, batch=SLOTS) -> str:
    """A step-time table file for this engine (device, model fingerprint) at `batch`."""
    table = cost_table.CostTable(batch, (64.0,), {k: (v,) for k, v in TABLE_MS.items()}, "test")
    cost_table.save(path, table, device=engine.device_kind, model=engine.fingerprint())
    return str(path)


class Server:
    def __init__(self, tmp_path, table: str):
        self.port = free_port()
        self.target = chat_model(tmp_path / NAME)
        _, drafter = demo_paths()
        cmd = [sys.executable, "-m", "ddtree_jax.cli.serve", "--target", self.target, "--drafter", drafter,
               "--dtype", "fp32", "--mode", MODE, "--budget", "auto",
               "--auto-budgets", ",".join(map(str, AUTO_BUDGETS)), "--cost-table", table, "--max-batch", str(SLOTS),
               "--max-context", str(MAX_CONTEXT), "--max-queue", str(QUEUE), "--chunk-steps", "2", "--max-top-k", "8",
               "--no-compact", "--no-warmup", "--port", str(self.port), "--shutdown-timeout", "5",
               "--log-level", "warning"]
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
        self.log = open(tmp_path / "server.log", "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self):
        deadline = time.time() + START_TIMEOUT
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"the server did not come up:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=600, **kw)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def by_choice(self, name: str) -> dict[str, float]:
        """{choice: value} of a budget-auto counter."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {c: float(v) for c, v in re.findall(rf'^{re.escape(name)}{{choice="([^"]+)"}} (\S+)$', text, re.M)}

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def engine():
    target, drafter = demo_paths()
    return Engine.load(target, drafter, dtype="fp32")


@pytest.fixture(scope="module")
def server(tmp_path_factory, engine):
    root = tmp_path_factory.mktemp("serve")
    s = Server(root, write_table(engine, root / "costs.json"))
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def ready(server, engine):
    """The server up and compiled: its first request (its compilations) runs while this process
    compiles the reference engine (two processes, two cores)."""
    server.wait_ready()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(lambda: server.client().completions.create(model=NAME, prompt="x", max_tokens=2))
        reference(engine, "x", 2)
        assert first.result().choices[0].finish_reason in ("stop", "length")
    return server


def reference(engine, prompt, max_tokens):
    """The request alone through Engine.generate's plain decoding: (token ids, text without the stop
    token, finish reason)."""
    [c] = engine.generate([prompt], mode="ar", max_new_tokens=max_tokens)
    ids = c.token_ids
    return ids, engine.tokenizer.decode(ids), c.finish_reason


def same_or_tie(engine, prompt, got: list[int], ref: list[int]) -> bool:
    """Whether greedy output `got` equals the plain reference `ref`. Where it does not, the first
    difference must be a near tie of the target's top two logits there (bench.top2_gap below
    bench.TIE_TOLERANCE), else the test fails; the outputs before it are equal."""
    if got == ref:
        return True
    k = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    ids = engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
    gap = bench.top2_gap(engine, ids + ref[:k])
    assert gap < bench.TIE_TOLERANCE[engine.cfg.dtype], f"{prompt!r}: {got} != {ref} at {k}, not a near tie ({gap:.2e})"
    return False


def test_models_health_and_completion(ready, engine):
    client = ready.client()
    assert [m.id for m in client.models.list().data] == [NAME]
    health = httpx.get(ready.url + "/health").json()
    assert health["status"] == "ok" and health["budget"] == "auto" and health["auto_objective"] == "tokens"
    assert health["auto_budgets"] == list(AUTO_BUDGETS) and health["cost_tables"][str(SLOTS)].startswith("loaded from")
    # the CPU's defaults (decision 0044): no chunk overlap, prefill calls of up to 512 padded tokens
    assert health["overlap"] is False and health["prefill_tokens"] == 512 and health["max_prefill"] == SLOTS
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True})
    ids, text, finish = reference(engine, PROMPTS[0], 12)
    choice = r.choices[0]
    if same_or_tie(engine, PROMPTS[0], choice.token_ids, ids):
        assert choice.text == text and choice.finish_reason == finish
    assert r.usage.completion_tokens == len(choice.token_ids)
    assert r.object == "text_completion"
    assert r.usage.prompt_tokens == len(engine.encode(PROMPTS[0]))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_completion_renders_the_template(ready, engine):
    messages = [{"role": "system", "content": "Python"}, {"role": "user", "content": "fib"}]
    r = ready.client().chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                               extra_body={"return_token_ids": True})
    rendered = "".join(f"# {m['role']}: {m['content']}\n" for m in messages)
    prompt_ids = engine.tokenizer.encode(rendered, add_special_tokens=False).ids
    ids, text, finish = reference(engine, prompt_ids, 10)
    if same_or_tie(engine, prompt_ids, r.choices[0].token_ids, ids):
        assert r.choices[0].message.content == text and r.choices[0].finish_reason == finish
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens == len(prompt_ids)


def test_streaming_completion_and_chat(ready, engine):
    client = ready.client()
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=14, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))
    ids, text, finish = reference(engine, PROMPTS[1], 14)
    got = [t for c in chunks if c.choices for t in (getattr(c.choices[0], "token_ids", None) or [])]
    if same_or_tie(engine, PROMPTS[1], got, ids):
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert chunks[-1].usage.completion_tokens == len(got) and not chunks[-1].choices
    chat = list(client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                               temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.object == "chat.completion.chunk" for c in chat)


@pytest.mark.slow  # ~35 s; the default run keeps test_load_test_script's concurrent requests and serve-core's
# test_continuous_batching_equals_each_request_alone
def test_sixteen_concurrent_requests(ready, engine):
    """Different prompts, lengths and temperatures in 4 slots; every greedy one is token-identical
    to the request decoded alone (up to near ties); a seeded sampled one does not depend on its
    neighbours."""
    client = ready.client()
    jobs = []
    for i in range(16):
        temperature = 0.0 if i % 2 == 0 else [0.6, 1.0, 1.3][i % 3]
        extra = {"return_token_ids": True, "top_k": 5} if i % 4 == 1 else {"return_token_ids": True}
        jobs.append(dict(model=NAME, prompt=PROMPTS[i % len(PROMPTS)] + " " * (i // 8), max_tokens=4 + i % 13,
                         temperature=temperature, seed=100 + i, top_p=0.9 if i % 4 == 3 else 1.0, extra_body=extra))
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda kw: client.completions.create(**kw), jobs))
    for job, r in zip(jobs, results):
        choice = r.choices[0]
        assert 1 <= r.usage.completion_tokens <= job["max_tokens"] and choice.finish_reason in ("stop", "length")
        if job["temperature"] == 0:
            ids, text, finish = reference(engine, job["prompt"], job["max_tokens"])
            if same_or_tie(engine, job["prompt"], choice.token_ids, ids):
                assert choice.text == text and choice.finish_reason == finish
    again = client.completions.create(**jobs[1])  # the same seeded sampled request, alone now
    assert again.choices[0].token_ids == results[1].choices[0].token_ids


def test_stop_strings_and_stop_ids(ready, engine):
    client = ready.client()
    ids, text, _ = reference(engine, PROMPTS[2], 16)
    cut = next(i for i in range(3, len(text) - 2) if text[i] not in " \n")  # a stop inside the text
    stop = text[cut : cut + 2]
    expect = text[: text.index(stop)]
    r = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=16, temperature=0, stop=[stop, "@@@"])
    assert r.choices[0].text == expect and r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=16, temperature=0, stop=stop,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expect
    r = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=16, temperature=0,
                                  extra_body={"stop_token_ids": [ids[3]], "return_token_ids": True})
    assert r.choices[0].token_ids == ids[: ids.index(ids[3]) + 1] and r.choices[0].finish_reason == "stop"


def wait_for(predicate, timeout=60.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_a_disconnect_frees_the_slot(ready):
    before = ready.metric('ddtree_requests_finished_total{reason="cancelled"}')
    body = {"model": NAME, "prompt": PROMPTS[3], "max_tokens": 100, "temperature": 0, "stream": True}
    with httpx.stream("POST", ready.url + "/v1/completions", json=body, timeout=600) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # generation has started
        assert wait_for(lambda: ready.metric("ddtree_active_slots") == 1)
    assert wait_for(lambda: ready.metric("ddtree_active_slots") == 0)
    assert ready.metric('ddtree_requests_finished_total{reason="cancelled"}') == before + 1


def test_a_full_queue_is_429_with_retry_after(ready):
    body = {"model": NAME, "prompt": PROMPTS[4], "max_tokens": 100, "temperature": 0, "stream": True}
    streams = []
    with httpx.Client(timeout=600) as http:
        try:
            for _ in range(SLOTS + QUEUE + 1):  # every slot, the queue, one more
                s = http.stream("POST", ready.url + "/v1/completions", json=body)
                streams.append(s)
                r = s.__enter__()
                if r.status_code != 200:
                    break
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert len(streams) > QUEUE  # the queue held QUEUE requests besides those in slots
            assert json.loads(r.read())["error"]["type"] == "rate_limit_error"
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    assert wait_for(lambda: ready.metric("ddtree_active_slots") == 0 and ready.metric("ddtree_queue_requests") == 0)


BAD = [
    ("/v1/completions", b"{not json", "invalid_json"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, "model"),
    ("/v1/completions", {"prompt": "x " * 200}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": MAX_CONTEXT}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 2}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": 1000}, "top_k"),
    ("/v1/completions", {"prompt": "x", "n": 3}, "n"),
    ("/v1/completions", {"prompt": [1, 10**6]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}, "max_tokens"),
]


@pytest.mark.parametrize("path, body, what", BAD, ids=[b[2] for b in BAD])
def test_bad_input_is_400_with_an_openai_error(ready, path, body, what):
    kw = ({"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes)
          else {"json": body})
    r = httpx.post(ready.url + path, timeout=60, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert what in (err["param"], err["code"]), err


def test_openai_client_raises_bad_request(ready):
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        ready.client().completions.create(model="nope", prompt="x", max_tokens=2)
    assert httpx.get(ready.url + "/v2/nothing").json()["error"]["message"]


def test_metrics_are_prometheus_text(ready):
    text = httpx.get(ready.url + "/metrics").text
    for name in ("ddtree_requests_total", "ddtree_generation_tokens_total", "ddtree_step_tokens_total",
                 "ddtree_row_steps_total", "ddtree_queue_requests", "ddtree_step_seconds_bucket",
                 "ddtree_time_to_first_token_seconds_bucket", "ddtree_request_acceptance_length_bucket"):
        assert name in text, name
    assert ready.metric("ddtree_step_tokens_total") / ready.metric("ddtree_row_steps_total") > 1  # speculation accepts


def test_metrics_count_the_auto_choices(ready):
    """ddtree_auto_*_total{choice}: every choice listed; the policy's row-steps account for every
    request's steps; speculative steps ran and accepted tokens."""
    steps = ready.by_choice("ddtree_auto_steps_total")
    assert set(steps) == set(TABLE_MS) and sum(steps.values()) > 0
    assert sum(v for c, v in steps.items() if c != "ar") > 0
    assert sum(ready.by_choice("ddtree_auto_row_steps_total").values()) == ready.metric("ddtree_row_steps_total")
    accepted = ready.by_choice("ddtree_auto_accepted_tokens_total")
    assert set(accepted) == set(TABLE_MS) and sum(accepted.values()) > 0 and accepted["ar"] == 0
    assert set(ready.by_choice("ddtree_auto_predicted_tokens_total")) == set(TABLE_MS)


@pytest.mark.parametrize("problem", ["missing", "not json", "other batch", "other device", "other budgets"])
def test_a_bad_cost_table_ends_the_command_before_serving(problem, engine, tmp_path, monkeypatch, capsys):
    """ddtree-serve --cost-table FILE: a missing, unreadable or unfitting table (another device, no
    table for a batch bucket, no time for a compiled budget) is one error naming the file and the
    problem, exit 2, before anything compiles or listens."""
    import signal as signals

    import uvicorn

    from ddtree_jax.cli import serve as cli

    path = tmp_path / "costs.json"
    if problem == "not json":
        path.write_text("{")
    elif problem == "other batch":
        write_table(engine, path, batch=2)
    elif problem == "other device":
        table = cost_table.CostTable(SLOTS, (64.0,), {k: (v,) for k, v in TABLE_MS.items()}, "test")
        cost_table.save(path, table, device="Another GPU", model=engine.fingerprint())
    elif problem == "other budgets":
        write_table(engine, path)
    monkeypatch.setattr(signals, "signal", lambda *a: None)
    monkeypatch.setattr(uvicorn.Server, "run", lambda *a, **k: pytest.fail("the server started"))
    target, drafter = demo_paths()
    budgets = "4,8" if problem == "other budgets" else ",".join(map(str, AUTO_BUDGETS))
    with pytest.raises(SystemExit) as e:
        cli.main(["--target", target, "--drafter", drafter, "--dtype", "fp32", "--max-batch", str(SLOTS),
                  "--no-compact", "--max-context", str(MAX_CONTEXT), "--auto-budgets", budgets,
                  "--cost-table", str(path)])
    out = capsys.readouterr()
    want = {"missing": "does not exist", "not json": "not readable JSON", "other batch": "no table for batch 4",
            "other device": "measured on 'Another GPU'", "other budgets": "has no times for ['8']"}[problem]
    assert e.value.code == 2 and str(path) in out.err and want in out.err, out.err
    assert out.err.startswith("ddtree-serve: error: "), out.err
    assert out.out == "" and "compiling" not in out.err


def test_load_test_script(ready, engine, tmp_path):
    """scripts/load_test.py's clients against the server, its static-batch run, its plot."""
    from scripts import load_test

    prompts = [engine.encode(p) for p in PROMPTS]
    requests = load_test.request_list(prompts, 4, 0, (2, 8), (2, 8))
    row = asyncio.run(load_test.run_level(ready.url, NAME, requests, 2, 120))
    assert row["requests"] == 4 and row["error_count"] == 0 and row["throughput_tok_s"] > 0
    assert row["ttft_ms"]["p50"] > 0 and row["itl_ms"]["p99"] >= row["itl_ms"]["p50"] >= 0
    static = load_test.static_batches(engine, requests, 1, MODE, BUDGET)
    assert load_test.build_parser().parse_args(["--budget", "auto"]).budget == "auto"
    for bad in (["--served-static"], ["--served-static", "--static-batch", "4", "--clients", "1,8"],
                ["--served-static", "--static-batch", "8", "--clients", "1,8", "--server-args", "--batching static"]):
        with pytest.raises(SystemExit) as e:  # named before any server starts
            load_test.main(bad + ["--out", str(tmp_path / "never.json")])
        assert e.value.code == 2
    assert load_test.build_parser().parse_args([]).budget == "auto"
    assert static["completion_tokens"] == row["completion_tokens"]  # greedy: the same tokens either way
    load_test.plot({"device": "cpu", "levels": {MODE: [row]}, "static": [dict(static, mode=MODE)]},
                   str(tmp_path / "load.png"))
    assert (tmp_path / "load.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="only targets this machine"):
        load_test.check_local("http://10.0.0.1:8000")
    args = load_test.build_parser().parse_args(["--cost-table", "t.json", "--server-args", "--max-batch 4"])
    ddtree, ar = (load_test.server_arguments(m, args, [1, 8], 96, 128) for m in ("ddtree", "ar"))
    assert ddtree[-4:] == ["--cost-table", "t.json", "--max-batch", "4"] and "--cost-table" not in ar
    assert ar[:4] == ["--budget", "auto", "--batch-buckets", "1,8"] and "224" in ar
    for argv in (["--modes", "ar", "--cost-table", "t.json"], ["--budget", "8", "--cost-table", "t.json"],
                 ["--cost-table", str(tmp_path / "missing.json")]):
        with pytest.raises(SystemExit) as e:
            load_test.main(argv)
        assert e.value.code == 2


def test_sigterm_stops_cleanly(ready):
    """In flight at SIGTERM: the stream finishes or is cancelled; new connections are refused; exit 0."""
    body = {"model": NAME, "prompt": PROMPTS[5], "max_tokens": 60, "temperature": 0, "stream": True}
    lines = []
    with httpx.stream("POST", ready.url + "/v1/completions", json=body, timeout=600) as r:
        it = r.iter_lines()
        lines.append(next(it))
        ready.proc.send_signal(signal.SIGTERM)
        lines.extend(it)
    assert ready.proc.wait(timeout=120) == 0, ready.output()
    lines = [x for x in lines if x]
    assert lines[-1] == "data: [DONE]"  # finished, or cancelled with an error event first
    last = json.loads(lines[-2][len("data: "):])
    assert last.get("choices", [{}])[0].get("finish_reason") in ("stop", "length") or "error" in last
    with pytest.raises(httpx.HTTPError):
        httpx.get(ready.url + "/health", timeout=5)
    assert "Traceback" not in ready.output()
