"""The pool's state as Prometheus gauges, read at every scrape (`GET /metrics`).

What is a state rather than an event (runners connected, requests in flight, queue depth,
each runner's KV cache, its models) is read from the pool when scraped, so it is always
consistent and costs nothing between scrapes. The pool registers its `PoolCollector` on its
metrics' registry (gateway.observability.metrics); the events are counted there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.pool.placement import RunnerConn


class PoolState(Protocol):
    """What the collector reads of the pool (gateway.pool.pool.Pool)."""

    @property
    def runners(self) -> Mapping[str, RunnerConn]: ...

    def models(self) -> set[str]: ...

    def queue_depth(self, model: str | None = None) -> int: ...

    def in_flight(self) -> int: ...


class PoolCollector(Collector):
    """Gauges read from the pool at scrape time."""

    def __init__(self, pool: PoolState) -> None:
        self.pool = pool

    def collect(self) -> Iterable[Metric]:
        pool = self.pool
        runners = list(pool.runners.values())
        yield _gauge("orchard_runners_connected", "Runners in the pool.", [([], len(runners))])
        yield _gauge(
            "orchard_gateway_tasks",
            "asyncio tasks alive on the gateway's event loop: flat under a steady load, so "
            "that growth shows a leak (a stream or connection task never ended).",
            [([], _tasks())],
        )
        yield _gauge(
            "orchard_requests_in_flight",
            "Requests running on a runner.",
            [([], pool.in_flight())],
        )
        yield _gauge(
            "orchard_queue_depth",
            "Requests waiting for a free slot, by model.",
            [([m], pool.queue_depth(m)) for m in sorted(pool.models())],
            ["model"],
        )
        yield _gauge(
            "orchard_runner_slots",
            "Requests a runner takes at once (its max_concurrent).",
            [([c.name, c.id], c.hello.max_concurrent) for c in runners],
            ["runner", "runner_id"],
        )
        kv = [c for c in runners if c.session.kv_bytes is not None]
        yield _gauge(
            "orchard_runner_kv_cache_bytes",
            "KV-cache memory a runner holds, from its last heartbeat.",
            [([c.name, c.id], _number(c.session.kv_bytes)) for c in kv],
            ["runner", "runner_id"],
        )
        limited = [c for c in runners if c.session.kv_limit_bytes is not None]
        yield _gauge(
            "orchard_runner_kv_cache_limit_bytes",
            "The KV-cache budget a runner reports, from its last heartbeat.",
            [([c.name, c.id], _number(c.session.kv_limit_bytes)) for c in limited],
            ["runner", "runner_id"],
        )
        tiers = [
            ([c.name, c.id, tier], _number(value))
            for c in runners
            for tier, value in (
                ("memory", c.session.kv_prefix_bytes),
                ("disk", c.session.kv_disk_bytes),
            )
            if value is not None
        ]
        yield _gauge(
            "orchard_runner_prefix_cache_bytes",
            "What a runner's kept prompt caches take, by tier (memory, disk), from its last "
            "heartbeat.",
            tiers,
            ["runner", "runner_id", "tier"],
        )
        disk_limited = [c for c in runners if c.session.kv_disk_limit_bytes is not None]
        yield _gauge(
            "orchard_runner_prefix_cache_disk_limit_bytes",
            "The most a runner's disk cache may take (--kv-disk).",
            [([c.name, c.id], _number(c.session.kv_disk_limit_bytes)) for c in disk_limited],
            ["runner", "runner_id"],
        )
        yield from _model_gauges(runners)
        yield from _speculation(runners)

    def describe(self) -> Iterable[Metric]:
        return []  # nothing to check at registration: the names are this module's own


def _speculation(runners: list[RunnerConn]) -> Iterable[Metric]:
    """Speculative decoding's drafted and accepted tokens, by runner and model (counters the
    runner keeps and reports in its heartbeats)."""
    specs = [(c, spec) for c in runners for spec in c.session.speculation]
    for what, help_text in (
        (
            "drafted",
            "Tokens a model's draft proposed (speculative decoding), from the "
            "runner's last heartbeat.",
        ),
        ("accepted", "Of the tokens a model's draft proposed, those the model kept."),
    ):
        family = CounterMetricFamily(
            f"orchard_runner_speculative_{what}_tokens",
            help_text,
            labels=["runner", "runner_id", "model", "draft_model"],
        )
        for c, spec in specs:
            count = spec.drafted if what == "drafted" else spec.accepted
            family.add_metric([c.name, c.id, spec.model, spec.draft_model], float(count))
        yield family


def _model_gauges(runners: list[RunnerConn]) -> Iterable[Metric]:
    """Each runner's models: their state, their weights, downloads under way, its budget."""
    models = [(c, info) for c in runners for info in c.infos()]
    yield _gauge(
        "orchard_runner_model_state",
        "1 for each model a runner serves, labelled with its state: loaded, loading, or "
        "loadable (on demand).",
        [([c.name, c.id, info.id, info.state], 1.0) for c, info in models],
        ["runner", "runner_id", "model", "state"],
    )
    sized = [(c, info) for c, info in models if info.size_bytes is not None]
    yield _gauge(
        "orchard_runner_model_bytes",
        "A runner's model's weights, once known (what it takes of the runner's budget).",
        [([c.name, c.id, info.id], _number(info.size_bytes)) for c, info in sized],
        ["runner", "runner_id", "model"],
    )
    fetching = [(c, info.id, info.download) for c, info in models if info.download]
    yield _gauge(
        "orchard_runner_model_download_bytes",
        "Bytes downloaded so far of a model a runner is downloading.",
        [([c.name, c.id, m], float(d.done_bytes)) for c, m, d in fetching if d],
        ["runner", "runner_id", "model"],
    )
    yield _gauge(
        "orchard_runner_model_download_size_bytes",
        "The whole download of a model a runner is downloading.",
        [([c.name, c.id, m], float(d.total_bytes)) for c, m, d in fetching if d],
        ["runner", "runner_id", "model"],
    )
    budgeted = [c for c in runners if c.hello.memory_budget_bytes is not None]
    yield _gauge(
        "orchard_runner_memory_budget_bytes",
        "What a runner's loaded models may take together (--max-memory).",
        [([c.name, c.id], _number(c.hello.memory_budget_bytes)) for c in budgeted],
        ["runner", "runner_id"],
    )


def _number(value: int | None) -> float:
    return float(value or 0)


def _tasks() -> int:
    """The event loop's tasks (0 when scraped off the loop, as a test may)."""
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:
        return 0


def _gauge(
    name: str,
    documentation: str,
    samples: Iterable[tuple[list[str], float]],
    labels: list[str] | None = None,
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=labels or [])
    for values, value in samples:
        family.add_metric(values, value)
    return family
