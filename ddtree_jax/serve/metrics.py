"""Prometheus metrics of a server (one registry per server, so several can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2)
ACCEPT_BUCKETS = (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12, 16)


class Metrics:
    """The scheduler's hooks (on_*) and the HTTP side's request counts, in their own registry."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, max_batch: int, mode: str, choices: tuple[str, ...] = ()):
        """choices: budget "auto"'s choice names (SlotBatch.choice_names: "ar", "dflash", budgets),
        whose counters start at 0."""
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ddtree_requests", "HTTP generation requests by endpoint and outcome",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("ddtree_requests_finished", "Generations ended, by finish reason", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter("ddtree_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("ddtree_generation_tokens", "Tokens generated (prefill's first included)",
                                         registry=r)
        self.row_steps = Counter("ddtree_row_steps", "Device steps summed over active requests", registry=r)
        self.step_tokens = Counter("ddtree_step_tokens", "Tokens emitted by those steps (over row_steps: the "
                                   "mean acceptance length)", registry=r)
        self.acceptance = Histogram("ddtree_request_acceptance_length", "Tokens per step of each finished request",
                                    buckets=ACCEPT_BUCKETS, registry=r)
        self.queue = Gauge("ddtree_queue_requests", "Requests waiting for a slot", registry=r)
        self.active = Gauge("ddtree_active_slots", "Slots holding a request", registry=r)
        self.slots = Gauge("ddtree_slots", "Slots (max batch)", registry=r)
        self.slots.set(max_batch)
        self.info = Gauge("ddtree_mode_info", "The speculative mode served", ["mode"], registry=r)
        self.info.labels(mode=mode).set(1)
        self.step_time = Histogram("ddtree_step_seconds", "Wall time per device step (a chunk's time / its steps)",
                                   buckets=STEP_BUCKETS, registry=r)
        self.chunk_time = Histogram("ddtree_chunk_seconds", "Wall time of a chunk of device steps, host sync included",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.batch_rows = Histogram("ddtree_chunk_batch_rows", "Batch rows a chunk ran (its bucket)",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.prefill_time = Histogram("ddtree_prefill_seconds", "Wall time of a prefill (of the requests that "
                                      "waited together), host read of their first tokens included",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_rows = Histogram("ddtree_prefill_requests", "Requests a prefill took at once",
                                      buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.queue_time = Histogram("ddtree_queue_seconds", "Time from submission to prefill",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("ddtree_time_to_first_token_seconds", "Time from submission to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("ddtree_request_seconds", "Time from submission to the end", buckets=LATENCY_BUCKETS,
                                 registry=r)
        # budget "auto": per choice ("ar" = plain decoding, "dflash", DDTree budgets), over all slots
        self.auto_steps = Counter("ddtree_auto_steps", "Device steps of budget auto, by the choice each ran",
                                  ["choice"], registry=r)
        self.auto_row_steps = Counter("ddtree_auto_row_steps", "Those steps summed over their active requests",
                                      ["choice"], registry=r)
        self.auto_accepted = Counter("ddtree_auto_accepted_tokens", "Draft tokens the target accepted in those "
                                     "steps (over row_steps: acceptance per request step)", ["choice"], registry=r)
        self.auto_predicted = Counter("ddtree_auto_predicted_tokens", "Accepted draft tokens the policy predicted "
                                      "for its scored steps (calibrated; over scored_row_steps, against accepted "
                                      "over row_steps: the calibration's error)", ["choice"], registry=r)
        self.auto_scored = Counter("ddtree_auto_scored_row_steps", "Row-steps whose draft the policy scored (all "
                                   "speculative ones, but the fixed-budget steps of a device chunk)", ["choice"],
                                   registry=r)
        for name in choices:
            for counter in (self.auto_steps, self.auto_row_steps, self.auto_accepted, self.auto_predicted,
                            self.auto_scored):
                counter.labels(choice=name)

    # ---- scheduler hooks -------------------------------------------------------------------
    def on_prefill(self, seconds: float, prompt_tokens: list[int], waited: list[float]) -> None:
        """One prefill of len(prompt_tokens) requests; each one's time in the queue."""
        self.prefill_time.observe(seconds)
        self.prefill_rows.observe(len(prompt_tokens))
        for w in waited:
            self.queue_time.observe(w)
        self.prompt_tokens.inc(sum(prompt_tokens))

    def on_steps(self, steps: int, tokens: int) -> None:
        self.row_steps.inc(steps)
        self.step_tokens.inc(tokens)

    def on_chunk(self, seconds: float, steps: int, rows: int, active: int) -> None:
        self.chunk_time.observe(seconds)
        self.batch_rows.observe(rows)
        if steps:
            self.step_time.observe(seconds / steps)

    def on_choices(self, names, steps, row_steps, predicted, accepted, scored) -> None:
        """A chunk's budget-auto statistics, per choice in `names` order."""
        for i, name in enumerate(names):
            if steps[i]:
                self.auto_steps.labels(choice=name).inc(int(steps[i]))
                self.auto_row_steps.labels(choice=name).inc(int(row_steps[i]))
                self.auto_accepted.labels(choice=name).inc(float(accepted[i]))
                self.auto_predicted.labels(choice=name).inc(float(predicted[i]))
                self.auto_scored.labels(choice=name).inc(int(scored[i]))

    def on_finish(self, reason: str, tokens: int, steps: int, ttft: float | None, seconds: float) -> None:
        self.finished.labels(reason=reason).inc()
        self.generation_tokens.inc(tokens)
        if steps:
            self.acceptance.observe((tokens - 1) / steps)
        if ttft is not None:
            self.ttft.observe(ttft)
        self.latency.observe(seconds)

    def on_load(self, queued: int, active: int) -> None:
        self.queue.set(queued)
        self.active.set(active)

    # ---- HTTP side -------------------------------------------------------------------------
    def on_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
