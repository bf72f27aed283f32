"""The serving core without HTTP, on a tiny random target: continuous batching reproduces each
request run alone, slots are reused and kept packed, the adaptive budget serves each request as
alone (text and request parsing: tests/test_serve_protocol.py)."""

import asyncio
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("fastapi")

# one worker runs the whole module under pytest -n (its compiled slots are shared)
pytestmark = pytest.mark.xdist_group("serve-core")

from ddtree_jax.routes import REFERENCE  # noqa: E402
from ddtree_jax.serve.scheduler import Closed, Delta, QueueFull, Request, Scheduler  # noqa: E402
from ddtree_jax.serve.slots import PrefillRequest, SlotBatch, batch_buckets, prompt_buckets  # noqa: E402
from ddtree_jax.speculative.cost_table import CostTable  # noqa: E402
from ddtree_jax.speculative import generate as gen  # noqa: E402
from ddtree_jax.speculative.generate import generate  # noqa: E402
from ddtree_jax.speculative.sampling import Sampling  # noqa: E402
from tests.cli_fixtures import char_tokenizer  # noqa: E402
from tests.scripted_proposers import ScriptedProposer  # noqa: E402
from tests.tiny_models import HYBRID, make_target  # noqa: E402

VOCAB, EOS, MAX_NEW = 128, 1, 32
CFG, GRAPHDEF, PARAMS = make_target({"vocab_size": VOCAB}, seed=5, base=HYBRID)
PROPOSER = ScriptedProposer(4, VOCAB, error_rate=0.5, seed=3)
TOKENIZER = char_tokenizer()


def engine():
    """What SlotBatch reads of an Engine, around the tiny target and a scripted drafter."""
    return types.SimpleNamespace(cfg=CFG, graphdef=GRAPHDEF, params=PARAMS, proposer=PROPOSER, drafter_params=None,
                                 routes=REFERENCE, stop_ids=(EOS,), max_context=512)


def alone(requests):
    """Each request by itself: plain greedy decoding of the target (speculative output equals it),
    cut at the request's max_new and stop ids (one batched call: rows are independent)."""
    n, t = len(requests), max(len(r.prompt_ids) for r in requests)
    prompt = np.zeros((n, t), np.int32)
    for i, r in enumerate(requests):
        prompt[i, : len(r.prompt_ids)] = r.prompt_ids
    res = generate(GRAPHDEF, PARAMS, jnp.asarray(prompt), jnp.asarray([len(r.prompt_ids) for r in requests]),
                   mode="ar", max_new_tokens=MAX_NEW, eos_ids=jnp.asarray([EOS], jnp.int32))
    out = []
    for r, row in zip(requests, np.asarray(res.tokens).tolist()):
        ids = [x for x in row if x >= 0][: r.max_new]
        stops = [i for i, x in enumerate(ids) if x in r.stop_ids]
        out.append(ids[: stops[0] + 1] if stops else ids)
    return out


async def collect(handles):
    out = []
    for h in handles:
        ids, text = [], ""
        while True:
            event = await asyncio.wait_for(h.events.get(), 120)
            if isinstance(event, Delta):
                ids += event.token_ids
                text += event.text
            else:
                out.append((ids, text, event))
                break
    return out


def run(scheduler, requests, cancel=()):
    async def main():
        loop = asyncio.get_running_loop()
        handles = [scheduler.submit(r, loop) for r in requests]
        for i in cancel:
            handles[i].cancel()
        return await collect(handles)

    return asyncio.run(main())


@pytest.fixture(scope="module")
def slots():
    return SlotBatch(engine(), mode="ddtree", budget=6, max_batch=2, max_context=64, max_top_k=8, max_stop_ids=2,
                     chunk_steps=2)


def test_buckets():
    assert batch_buckets(1) == (1,) and batch_buckets(6) == (1, 2, 4, 6) and batch_buckets(8) == (1, 2, 4, 8)
    assert prompt_buckets(64) == (16, 32, 64) and prompt_buckets(100) == (16, 32, 64, 100)


def serve_watching_chunks(slots, requests, watch, log=None, overlap=True, batching="continuous"):
    """The requests through a Scheduler over `slots` (stopped after): its results and the scheduler;
    watch(n_active, report) sees every chunk's report; log (a list) gets "launch" and "report" as
    chunks are dispatched and their reports read."""
    launch = slots.launch
    log = [] if log is None else log

    def watched(n, steps=None):
        log.append("launch")
        pending = launch(n, steps)
        result = pending.result

        def report():
            r = result()
            log.append("report")
            watch(n, r)
            return r

        pending.result = report
        return pending

    slots.launch = watched
    scheduler = Scheduler(slots, TOKENIZER, max_queue=16, overlap=overlap, batching=batching)
    scheduler.start()
    try:
        return run(scheduler, requests), scheduler
    finally:
        scheduler.stop()
        slots.launch = launch


def test_continuous_batching_equals_each_request_alone(slots):
    """More requests than slots, of different lengths, greedy and sampled: each greedy one is
    exactly its lone plain decoding; slots are reused (rows move to keep the active ones packed)
    and every chunk runs the batch bucket of the active requests only."""
    rng = np.random.default_rng(0)
    requests = []
    for i in range(10):
        prompt = tuple(int(t) for t in rng.integers(2, VOCAB, rng.integers(3, 16)))  # one prompt bucket
        max_new = int(rng.integers(2, MAX_NEW))
        stop = (int(rng.integers(2, VOCAB)),) if i % 3 == 0 else ()
        sampling = Sampling() if i % 4 else Sampling(temperature=0.8, top_k=5, top_p=0.9)
        requests.append(Request(prompt, max_new, sampling, seed=i, stop_ids=stop))
    refs = [ref if r.sampling.greedy else None for r, ref in zip(requests, alone(requests))]
    rows = []
    results, scheduler = serve_watching_chunks(slots, requests, lambda n, report: rows.append(slots.rows_for(n)))
    for req, ref, (ids, text, fin) in zip(requests, refs, results):
        assert fin.completion_tokens == len(ids) and fin.prompt_tokens == len(req.prompt_ids)
        if ref is not None:
            assert ids == ref, req
        assert len(ids) <= req.max_new
        last_stops = ids[-1] in (EOS,) + req.stop_ids
        assert fin.reason == ("stop" if last_stops else "length")
        assert text == TOKENIZER.decode(ids[:-1] if last_stops else ids)
    assert set(rows) == {1, 2}, rows  # the last request alone runs batch 1
    assert scheduler.active == 0 and bool(np.asarray(slots.state.done).all())


def test_the_next_chunk_runs_while_the_host_streams(slots):
    """Chunk k + 1 is dispatched before chunk k's report is read (the device does not wait for the
    host's streaming); the reports are read in order (the last chunk, which carries only ended
    requests, may still be in flight when the scheduler stops); the output is unchanged."""
    requests = [Request((3, 4, 5), 14, Sampling(), 0), Request((6, 7), 9, Sampling(), 0)]
    log = []
    results, _ = serve_watching_chunks(slots, requests, lambda n, report: None, log)
    assert log[:3] == ["launch", "launch", "report"], log
    assert log.count("launch") - log.count("report") in (0, 1) and all(
        log[: i + 1].count("report") <= log[: i + 1].count("launch") for i in range(len(log)))
    assert [ids for ids, _, _ in results] == alone(requests)
    log.clear()  # without overlap: each report is read before the next chunk is dispatched
    results, _ = serve_watching_chunks(slots, requests, lambda n, report: None, log, overlap=False)
    assert log == ["launch", "report"] * (len(log) // 2), log
    assert [ids for ids, _, _ in results] == alone(requests)


def serve_all_queued(slots, requests, prefill_many=None):
    """The requests queued before a Scheduler over `slots` starts (its first admission sees them
    all), with slots.prefill_many replaced by prefill_many(the real one, requests) if given; the
    scheduler is stopped after. Returns (results, scheduler)."""
    real = slots.prefill_many
    if prefill_many is not None:
        slots.prefill_many = lambda reqs: prefill_many(real, reqs)
    scheduler = Scheduler(slots, TOKENIZER, max_queue=8)

    async def main():
        loop = asyncio.get_running_loop()
        handles = [scheduler.submit(r, loop) for r in requests]
        scheduler.start()
        return await collect(handles)

    try:
        return asyncio.run(main()), scheduler
    finally:
        scheduler.stop()
        slots.prefill_many = real


def test_a_burst_is_prefilled_together(slots):
    """Requests waiting together are prefilled in one call (prompts of different length buckets);
    one that ends at its first token takes no slot, the next waiting one takes it; each greedy
    request equals its lone decoding."""
    requests = [Request(tuple(range(3, 23)), 1, Sampling(), 0),  # 20 tokens: prompt bucket 32; ends at once
                Request((5, 6, 7), 12, Sampling(), 0),
                Request((9, 10, 11, 12), 9, Sampling(), 0)]
    calls = []

    def counting(real, reqs):
        calls.append(len(reqs))
        return real(reqs)

    results, _ = serve_all_queued(slots, requests, counting)
    assert calls == [2, 1], calls  # two free slots: the first two together, the third after a chunk
    assert [ids for ids, _, _ in results] == alone(requests)
    assert results[0][2].reason == "length" and results[0][2].steps == 0


def test_static_batching_admits_only_into_an_empty_batch(slots):
    """batching "static" (the baseline): with two slots and four waiting requests, the second
    pair is prefilled only after both of the first have ended, though one ends much earlier; the
    output is unchanged."""
    requests = [Request((3, 4, 5), 3, Sampling(), 0), Request((6, 7), 20, Sampling(), 0),
                Request((8, 9, 10), 6, Sampling(), 0), Request((11, 12), 5, Sampling(), 0)]
    log = []
    real = slots.prefill_many
    slots.prefill_many = lambda reqs: (log.append(("prefill", len(reqs))), real(reqs))[1]
    try:
        results, _ = serve_watching_chunks(slots, requests, lambda n, report: log.append(("chunk", n)),
                                           batching="static")
    finally:
        slots.prefill_many = real
    assert [ids for ids, _, _ in results] == alone(requests)
    second = log.index(("prefill", 2), 1)  # the second batch's prefill
    # the short request ended early and the long one ran on alone: no request joined it
    assert ("chunk", 1) in log[1:second] and log[second - 1] == ("chunk", 1), log
    with pytest.raises(ValueError, match="batching must be one of"):
        Scheduler(slots, TOKENIZER, batching="dynamic")


def test_prefill_groups_sort_by_length_within_the_token_budget():
    """Waiting requests go to prefill calls by prompt length (short first), each call within
    max_prefill requests and prefill_tokens padded tokens (rows bucket x prompt bucket); a request
    over the budget alone gets a call of its own."""
    lengths = [40, 3, 5, 20, 4, 17, 60]  # prompt buckets 16, 32, 64
    s = SlotBatch(engine(), mode="ar", max_batch=8, max_context=64, prefill_tokens=64)
    assert s.prefill_groups(lengths) == [[1, 4, 2], [5, 3], [0], [6]]  # 4 x 16, 2 x 32, 1 x 64, 1 x 64
    s = SlotBatch(engine(), mode="ar", max_batch=8, max_context=64, max_prefill=2, prefill_tokens=64)
    assert s.prefill_groups(lengths) == [[1, 4], [2, 5], [3], [0], [6]]
    wide = SlotBatch(engine(), mode="ar", max_batch=8, max_context=64)  # 2048 tokens: one call
    assert wide.prefill_groups(lengths) == [[1, 4, 2, 5, 3, 0, 6]]
    one = SlotBatch(engine(), mode="ar", max_batch=8, max_context=64, max_prefill=1)
    assert one.prefill_buckets == (1,) and one.prefill_groups(lengths) == [[1], [4], [2], [5], [3], [0], [6]]
    with pytest.raises(ValueError, match="prefill_tokens must be >= 1"):
        SlotBatch(engine(), mode="ar", max_batch=8, max_context=64, prefill_tokens=0)


def test_a_failing_prefill_ends_every_request_it_took(slots):
    """A device or internal failure in a prefill stops the loop, and every request learns of it:
    those taken off the queue for the failed call as well as those still queued."""

    def failing(real, reqs):
        raise RuntimeError("device lost")

    requests = [Request((3 + i, 4), 5, Sampling(), 0) for i in range(3)]
    results, scheduler = serve_all_queued(slots, requests, failing)
    assert [fin.reason for _, _, fin in results] == ["error"] * 3
    assert all("device lost" in fin.message for _, _, fin in results)
    assert isinstance(scheduler.error, RuntimeError) and not scheduler.alive


def test_prefilled_rows_go_only_where_they_are_put():
    """prefill_many pads three requests to the prefill bucket of 4; insert puts row j into slots[j]
    and nothing else anywhere (the padding row and a request done at its first token are dropped:
    the other slots keep every field); the inserted rows then generate as they would alone."""
    s = SlotBatch(engine(), mode="ddtree", budget=6, max_batch=4, max_context=64, max_top_k=8, max_stop_ids=2,
                  chunk_steps=3, buckets=(4,))
    assert s.prefill_buckets == (1, 2, 4)
    requests = [Request((5, 6, 7), 10, Sampling(), 0), Request((8, 9), 1, Sampling(), 0),
                Request(tuple(range(2, 22)), 8, Sampling(), 0)]
    s.state = s.state._replace(n_out=jnp.arange(4, dtype=jnp.int32) + 100)  # tell the slots apart
    marked = jax.tree.map(np.asarray, s.state)  # (insert donates the state)
    pre = s.prefill_many([PrefillRequest(r.prompt_ids, r.sampling, r.seed, r.max_new) for r in requests])
    assert pre.state.done.shape == (4,) and pre.done == (False, True, False)
    s.insert(pre, [1, None, 0])
    for slot, row in ((2, None), (3, None), (1, 0), (0, 2)):
        got = gen.map_rows(lambda x, slot=slot: x[slot], s.state)
        want = gen.map_rows(lambda x, slot=slot: x[slot], marked) if row is None else \
            gen.map_rows(lambda x, row=row: x[row], pre.state)
        for f in gen.ROW_FIELDS:
            for g, w in zip(jax.tree.leaves(getattr(got, f)), jax.tree.leaves(getattr(want, f))):
                if row is None or g.shape == w.shape:  # the prefill's caches are shorter: compared below
                    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"slot {slot} {f}")
    out = [[pre.first[2]], [pre.first[0]]]
    while True:
        report = s.advance(2)
        for r in range(2):
            out[r] += report.tokens[r, : report.n_new[r]].tolist()
        if report.done.all():
            break
    assert out == [alone([requests[2]])[0], alone([requests[0]])[0]]


@pytest.mark.parametrize("mode", ["ar", "dflash"])
def test_the_other_modes_serve_the_same_tokens(mode):
    slots = SlotBatch(engine(), mode=mode, budget=6, max_batch=2, max_context=64, max_stop_ids=1, chunk_steps=3,
                      buckets=(2,))
    requests = [Request((3 + i, 40, 41 + i), 6 + 5 * i, Sampling(), 0, stop_ids=(50,) if i == 1 else ())
                for i in range(3)]
    scheduler = Scheduler(slots, TOKENIZER, max_queue=4)
    scheduler.start()
    try:
        results = run(scheduler, requests)
    finally:
        scheduler.stop()
    assert [ids for ids, _, _ in results] == alone(requests)


# ---- budget "auto" ---------------------------------------------------------------------------
AUTO_NAMES = ("ar", "dflash", "3", "6")


def table(rows, ar, spec):
    """A step-time table for batch `rows`: plain steps ar ms, every speculative choice about spec ms."""
    ms = {"ar": (ar,), "dflash": (spec,), "3": (spec * 1.02,), "6": (spec * 1.05,)}
    return CostTable(rows, (16.0,), ms, f"test table {ar}/{spec}")


@pytest.fixture(scope="module")
def auto_slots():
    """Budget auto over budgets 3 and 6, batch buckets 1 and 2; its tables measured at start-up."""
    slots = SlotBatch(engine(), mode="ddtree", budget="auto", auto_budgets=(3, 6), max_batch=2, max_context=64,
                      max_top_k=8, max_stop_ids=2, chunk_steps=2)
    seconds = slots.measure_costs(steps=2, repeats=1)
    assert set(seconds) == {1, 2}
    return slots


def test_auto_start_up_tables_and_objective(auto_slots):
    """The server's objective is the batch's tokens per second; a table per batch bucket, measured in
    the serving program (no compilation beyond one chunk program per bucket), without the synthetic
    prompt's acceptance; the slots end idle, the policy with nothing learned."""
    assert auto_slots.auto.objective == "tokens" and auto_slots.choice_names == AUTO_NAMES
    for rows in (1, 2):
        t = auto_slots.tables[rows]
        assert t.batch == rows and set(t.ms) == set(AUTO_NAMES) and all(v[0] > 0 for v in t.ms.values())
        assert t.source.startswith(f"measured at start-up in the serving program (batch {rows}")
        assert t.ratios == {} and t.accepted == {}
    assert auto_slots._chunk._cache_size() == 2
    a = auto_slots.state.adapt
    assert bool(np.asarray(auto_slots.state.done).all()) and not bool(a.have_e) and int(a.force) == -1
    with pytest.raises(ValueError, match="a step-time table is for mode ddtree"):
        SlotBatch(engine(), mode="dflash", budget="auto", max_batch=2, max_context=64, cost_table={2: table(2, 1, 2)})
    with pytest.raises(ValueError, match=r"no step-time table for batch 1 .*no times for \['6'\]"):
        SlotBatch(engine(), budget="auto", auto_budgets=(3, 6), max_batch=2, max_context=64,
                  cost_table={2: CostTable(2, (16.0,), {"ar": (1,), "dflash": (2,), "3": (2,)}, "short")})


def test_auto_serves_each_request_as_alone(auto_slots):
    """Budget auto under continuous batching (rows joining, leaving and moving between slots, the
    batch bucket changing): greedy requests are token-identical to plain decoding alone, the policy
    ran plain and speculative steps, and its per-choice statistics account for every row-step."""
    auto_slots.tables = {1: table(1, 1.0, 2.2), 2: table(2, 1.0, 2.4)}
    auto_slots._install_tables()
    rng = np.random.default_rng(1)
    requests = [Request(tuple(int(t) for t in rng.integers(2, VOCAB, rng.integers(3, 16))),
                        int(rng.integers(4, MAX_NEW)),
                        Sampling() if i % 3 else Sampling(temperature=0.9), seed=i, stop_ids=(7,) if i == 2 else ())
                for i in range(7)]
    refs = alone(requests)
    reports = []
    results, _ = serve_watching_chunks(auto_slots, requests, lambda n, report: reports.append(report))
    for req, ref, (ids, _, fin) in zip(requests, refs, results):
        assert fin.reason in ("stop", "length")
        if req.sampling.greedy:
            assert ids == ref, req
    steps = sum(r.choice_steps for r in reports)
    assert steps[0] > 0 and steps[1:].sum() > 0, steps  # plain and speculative steps both ran
    assert sum(fin.steps for _, _, fin in results) == int(sum(r.choice_rows for r in reports).sum())
    assert all(int(r.choice_steps.sum()) <= auto_slots.chunk_steps for r in reports)  # restarts every chunk
    assert auto_slots._chunk._cache_size() == 2  # the tables are data: nothing recompiled


@pytest.mark.slow  # ~32 s; continuous batching equal to each request alone stays in the default run
def test_auto_device_chunks_serve_each_request_as_alone():
    """Budget auto in device chunks of 5 across the server's chunks of 2 steps: greedy requests are
    token-identical to plain decoding alone while rows join and leave a running chunk; a chunk cut
    by a server chunk's end goes on in the next (its plan carries over); every row-step counted."""
    slots = SlotBatch(engine(), mode="ddtree", budget="auto", auto_budgets=(3, 6), max_batch=2, max_context=64,
                      max_top_k=8, max_stop_ids=2, chunk_steps=2, decide_every=5,
                      cost_table={1: table(1, 1.0, 1.5), 2: table(2, 1.0, 1.5)})
    assert slots.auto.device_chunks and slots.auto.form == "device chunks of 5"
    rng = np.random.default_rng(2)
    requests = [Request(tuple(int(t) for t in rng.integers(2, VOCAB, rng.integers(3, 16))),
                        int(rng.integers(4, MAX_NEW)), Sampling(), seed=i) for i in range(5)]
    refs = alone(requests)
    reports, plans = [], []
    results, _ = serve_watching_chunks(slots, requests, lambda n, report: (
        reports.append(report), plans.append(int(np.asarray(slots.state.adapt.plan)[1]))))
    for req, ref, (ids, _, _) in zip(requests, refs, results):
        assert ids == ref, req
    assert max(plans) > 0  # some server chunk ended inside a device chunk, which went on
    assert sum(fin.steps for _, _, fin in results) == int(sum(r.choice_rows for r in reports).sum())
    with pytest.raises(ValueError, match="decide_every must be an integer >= 0"):
        SlotBatch(engine(), mode="ddtree", budget="auto", max_batch=2, max_context=64, decide_every=-1)


def test_a_reused_slot_starts_afresh(auto_slots):
    """A request that takes a slot over starts with the population's expectation, not the evicted
    request's moving average, and the probe wait restarts; a moved request keeps its own; the
    calibration persists."""
    auto_slots.tables = {1: table(1, 1.0, 2.2), 2: table(2, 1.0, 2.2)}
    auto_slots._install_tables()
    first = [auto_slots.prefill((3 + i, 40, 41 + i), Sampling(), 0, 40) for i in range(2)]
    for slot, row in enumerate(first):
        auto_slots.insert(row, [slot])
    for _ in range(4):
        auto_slots.advance(2)
    a = auto_slots.state.adapt
    assert bool(a.have_e) and np.asarray(a.pop_e)[1:].min() > 0  # a speculative step taught E
    row_e = np.asarray(a.row_e) + np.asarray([[7.0], [9.0]], np.float32)  # the rows' own values, told apart
    auto_slots.state = auto_slots.state._replace(adapt=a._replace(row_e=jnp.asarray(row_e)))
    pop_e = np.asarray(a.pop_e)
    calibration = [np.asarray(x) for x in (a.real, a.pred, a.all_real, a.all_pred)]
    auto_slots.move(1, 0)  # request 0 leaves; request 1 moves into slot 0 with its own state
    a = auto_slots.state.adapt
    np.testing.assert_array_equal(np.asarray(a.row_e)[0], row_e[1])
    auto_slots.state = auto_slots.state._replace(adapt=auto_slots.state.adapt._replace(gap=jnp.int32(64)))
    auto_slots.insert(auto_slots.prefill((9, 10, 11), Sampling(), 0, 20), [1])  # a new request in slot 1
    a = auto_slots.state.adapt
    assert int(a.gap) == 1  # the probe wait restarts from the shortest for the new request
    np.testing.assert_array_equal(np.asarray(a.row_e)[1], pop_e)
    np.testing.assert_array_equal(np.asarray(a.row_e)[0], row_e[1])
    for before, after in zip(calibration, (a.real, a.pred, a.all_real, a.all_pred)):
        np.testing.assert_array_equal(np.asarray(after), before)
    auto_slots.move(1, 1)
    auto_slots.move(0, 0)
    assert bool(np.asarray(auto_slots.state.done).all())


def test_sampled_rows_depend_on_their_seed_only(slots):
    """A seeded sampled request gives the same tokens alone and beside others."""
    req = Request((5, 9, 17, 33), 20, Sampling(temperature=1.0), seed=1234)
    others = [Request((7, 8, 9), 25, Sampling(temperature=0.7, top_p=0.8), seed=s) for s in range(3)]
    scheduler = Scheduler(slots, TOKENIZER, max_queue=8)
    scheduler.start()
    try:
        [lone] = run(scheduler, [req])
        mixed = run(scheduler, others[:2] + [req] + others[2:])
    finally:
        scheduler.stop()
    assert lone[0] == mixed[2][0]
    assert len({tuple(m[0]) for m in mixed}) > 1


@pytest.mark.parametrize("workers", [1, 3])
def test_warm_up_leaves_the_slots_idle(slots, workers):
    """Sequential or with the programs compiled several at a time first: the slots end idle, and a
    request afterwards compiles nothing more."""
    slots.warm_up(max_prompt=16, workers=workers)
    assert bool(np.asarray(slots.state.done).all())
    sizes = slots._chunk._cache_size(), slots._start._cache_size()
    pre = slots.prefill_many([PrefillRequest([3, 4, 5], Sampling(), 0, 4)])
    slots.insert(pre, [0])
    slots.advance(1)
    assert (slots._chunk._cache_size(), slots._start._cache_size()) == sizes


def test_cancelled_and_overflowing_requests(slots):
    scheduler = Scheduler(slots, TOKENIZER, max_queue=2)  # not started: the queue only fills

    async def fill():
        loop = asyncio.get_running_loop()
        req = Request((3, 4), 5, Sampling(), 0)
        handles = [scheduler.submit(req, loop) for _ in range(2)]
        with pytest.raises(QueueFull):
            scheduler.submit(req, loop)
        handles[0].cancel()
        scheduler.start()
        out = await collect(handles)
        scheduler.close()
        with pytest.raises(Closed):
            scheduler.submit(req, loop)
        return out

    try:
        first, second = asyncio.run(fill())
    finally:
        scheduler.stop()
    assert first[2].reason == "cancelled" and first[0] == []
    assert second[2].reason in ("stop", "length") and second[0]
