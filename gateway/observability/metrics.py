"""The gateway's Prometheus metrics (`GET /metrics`), on one registry per app.

Events are counted where they happen: a request's `Meter` (one per `RequestStream`) times
its first token and its chunks and, when the stream ends, counts it by outcome with its
usage; the pool counts runner joins, losses, failovers, cancellations and queue waits.
What is a state rather than an event (runners connected, requests in flight, queue depth,
each runner's KV cache) is read from the pool when scraped
(`gateway.observability.collector.PoolCollector`), so it is always consistent and costs
nothing between scrapes.

Labels stay low-cardinality: `model` is a model some runner served (a name no runner serves
is counted as "unknown"), `dialect` is the API the client spoke, `outcome` is "ok",
"cancelled" or an error kind (`error_kind`).
"""

from __future__ import annotations

import time
from typing import Final

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

from gateway.errors import GatewayError
from gateway.observability.history import PoolHistory
from protocol.frames import Chunk, Error, Usage

Dialect = str
"""chat, completions, responses, anthropic, ollama, websocket."""

UNKNOWN_MODEL: Final = "unknown"

TTFT_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
GAP_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.25, 0.5, 1.0, 5.0,
)  # fmt: skip
QUEUE_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

GAP_EVERY: Final = 4
"""The inter-token gap is observed at every this many chunks of a stream (chunks 4, 8, ...
after the first): a histogram observation costs about 1 µs, a clock read 0.1 µs, against a
few µs of gateway CPU per relayed chunk."""


def error_kind(problem: GatewayError | Error) -> str:
    """The `outcome` label of a request that failed: a runner error frame's code, or the
    gateway error's own (`GatewayError.outcome`, else its code)."""
    if isinstance(problem, Error):
        return problem.code
    return problem.outcome or problem.code


class Metrics:
    """Every metric of one gateway, on its own registry (tests run many gateways in one
    process, so nothing goes to prometheus-client's global one)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.history = PoolHistory()
        """The last minutes, for the console's charts (gateway.observability.history)."""
        r = self.registry
        self.requests = Counter(
            "orchard_requests",
            "Requests by model, API dialect and outcome (ok, cancelled, or an error kind). "
            "One per generation given to the pool (a multi-prompt completion counts each "
            "prompt), plus requests refused before one was.",
            ["model", "dialect", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "orchard_prompt_tokens",
            "Prompt tokens, from the usage each request ended with.",
            ["model"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "orchard_cached_prompt_tokens",
            "Prompt tokens served from a runner's prefix cache.",
            ["model"],
            registry=r,
        )
        self.prompt_tokens_by_source = Counter(
            "orchard_prompt_tokens_by_source",
            "Prompt tokens of finished requests by where they came from: a runner's prefix "
            "cache in memory, its disk cache, or prefilled.",
            ["runner", "model", "source"],
            registry=r,
        )
        self.routing = Counter(
            "orchard_routing_decisions",
            "Where requests went: to the runner holding the longest prefix of them "
            '("affinity"), to another one because that runner was full or had more prefill '
            'waiting ("load"), or with no runner holding any of it ("miss").',
            ["model", "decision"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "orchard_completion_tokens",
            "Completion tokens, from the usage each request ended with.",
            ["model"],
            registry=r,
        )
        self.ttft = Histogram(
            "orchard_time_to_first_token_seconds",
            "From the request given to the pool (queue wait included) to its first chunk "
            "from a runner.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.gap = Histogram(
            "orchard_inter_token_gap_seconds",
            "Time between two chunks of a request arriving from its runner, divided by the "
            f"tokens the later one carries; sampled: every {GAP_EVERY}th chunk of a request.",
            ["model"],
            buckets=GAP_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "orchard_queue_wait_seconds",
            "Time a request waited for a runner's free slot (0: placed at once).",
            ["model"],
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.cancellations = Counter(
            "orchard_cancellations",
            "Requests cancelled on their runner (client gone or asked to stop).",
            ["model"],
            registry=r,
        )
        self.tokens_after_cancel = Counter(
            "orchard_tokens_after_cancel",
            "Completion tokens a runner produced for a request after the gateway cancelled it.",
            ["model"],
            registry=r,
        )
        self.runner_joins = Counter(
            "orchard_runner_joins", "Runners that joined the pool.", registry=r
        )
        self.runner_losses = Counter(
            "orchard_runner_losses",
            "Runners that left the pool (closed, drained, or dropped as silent).",
            registry=r,
        )
        self.failovers = Counter(
            "orchard_failovers",
            "Requests moved to another runner before their first token.",
            registry=r,
        )
        self.model_loads = Counter(
            "orchard_model_loads",
            "Loads of a model on demand by a runner, by outcome: ok, or failed (the requests "
            "waiting for it got model_load_failed).",
            ["model", "outcome"],
            registry=r,
        )
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)

    def prompt_sources(self, runner: str, model: str, chunk: Chunk) -> None:
        """Count a finished request's prompt tokens by where they came from."""
        usage = chunk.usage
        disk = chunk.stats.cached_disk_tokens if chunk.stats is not None else 0
        disk = min(disk, usage.cached_tokens)
        by_source = self.prompt_tokens_by_source
        by_source.labels(runner, model, "memory").inc(usage.cached_tokens - disk)
        by_source.labels(runner, model, "disk").inc(disk)
        by_source.labels(runner, model, "prefilled").inc(
            max(usage.prompt_tokens - usage.cached_tokens, 0)
        )

    def meter(self, model: str, dialect: Dialect) -> Meter:
        return Meter(self, model, dialect)

    def refused(self, model: str, dialect: Dialect, outcome: str) -> None:
        """A request that ended before it had a stream (unknown model, queue full...)."""
        self.requests.labels(model, dialect, outcome).inc()


class Meter:
    """One request's metrics: its labelled children are resolved once, here, so that most
    chunks cost a counter and an attribute, and one in `GAP_EVERY` a histogram observation."""

    __slots__ = (
        "_cancel_tokens",
        "_chunks",
        "_gap",
        "_last",
        "_ttft",
        "_usage",
        "dialect",
        "ended",
        "metrics",
        "model",
        "runner",
        "started",
    )

    def __init__(self, metrics: Metrics, model: str, dialect: Dialect) -> None:
        self.metrics = metrics
        self.model = model
        self.dialect = dialect
        self.started = time.perf_counter()
        self.ended = False
        self.runner = ""
        """The runner's name, once the request has one (for the console's history)."""
        self._ttft = metrics.ttft.labels(model)
        self._gap = metrics.gap.labels(model)
        self._last = 0.0
        self._chunks = 0
        self._usage: Usage | None = None
        self._cancel_tokens: int | None = None

    def chunk(self, chunk: Chunk, cancelled: bool) -> None:
        """A chunk arrived from the runner (the per-token path)."""
        self._usage = chunk.usage
        n = self._chunks
        self._chunks = n + 1
        phase = n % GAP_EVERY
        if phase == GAP_EVERY - 1:  # the clock is read only around the sampled gaps
            self._last = time.perf_counter()
        elif phase == 0:
            if n == 0:
                now = time.perf_counter()
                ttft = now - self.started
                self._ttft.observe(ttft)
                self.metrics.history.first_token(self.model, self.runner, ttft, now)
            else:
                self._gap.observe((time.perf_counter() - self._last) / (chunk.tokens or 1))
        if chunk.finish_reason is not None:
            self.end("cancelled" if cancelled else "ok")

    def fail(self, problem: GatewayError | Error, cancelled: bool) -> None:
        """The request ended without a final chunk."""
        self.end("cancelled" if cancelled else error_kind(problem))

    def cancel(self) -> None:
        """The gateway asked the runner to stop the request."""
        if self._cancel_tokens is None and not self.ended:
            usage = self._usage
            self._cancel_tokens = usage.completion_tokens if usage is not None else 0
            self.metrics.cancellations.labels(self.model).inc()

    def end(self, outcome: str) -> None:
        """Count the request once, with the usage it ended with."""
        if self.ended:
            return
        self.ended = True
        m, model = self.metrics, self.model
        m.requests.labels(model, self.dialect, outcome).inc()
        usage = self._usage
        if usage is None:
            return
        m.prompt_tokens.labels(model).inc(usage.prompt_tokens)
        m.cached_tokens.labels(model).inc(usage.cached_tokens)
        m.completion_tokens.labels(model).inc(usage.completion_tokens)
        if self._cancel_tokens is not None:
            late = usage.completion_tokens - self._cancel_tokens
            m.tokens_after_cancel.labels(model).inc(max(late, 0))
