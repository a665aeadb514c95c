"""The last few minutes of the pool, for the console's charts: tokens per second and time to
first token (p50, p99), per runner and per model, in buckets of `BUCKET_S` seconds.

Fed two ways, both off the per-token path:

- `first_token(model, runner, seconds, now)`: a request's time to first token, from its meter
  (`metrics.Meter`), once per request;
- `observe_runners(now, runners)`: each runner's cumulative generated tokens, read by every
  console socket about once a second; what a runner generated since the last reading is put
  in the buckets the interval covers (spread evenly when no console was watching), and
  counts for its model too (a runner's tokens split evenly between its models).

`view(now)` is what `pool.state` carries: the series, oldest bucket first, the current
(partial) bucket last. Pure bookkeeping: the caller gives the time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import attrs

BUCKET_S = 5.0
"""Seconds per bucket."""
BUCKETS = 60
"""Buckets kept: five minutes."""


@attrs.define
class _Bucket:
    tokens: dict[tuple[str, str], float] = attrs.field(factory=dict)
    """Tokens generated, by ("runner" | "model", name)."""
    ttft: dict[tuple[str, str], list[float]] = attrs.field(factory=dict)
    """Times to first token in seconds, by ("runner" | "model", name)."""


@attrs.frozen
class RunnerReading:
    """One runner as `observe_runners` reads it."""

    id: str
    name: str
    models: tuple[str, ...]
    tokens_generated: int


class PoolHistory:
    """See the module docstring."""

    def __init__(self, bucket_s: float = BUCKET_S, buckets: int = BUCKETS) -> None:
        self.bucket_s = bucket_s
        self.buckets = buckets
        self._buckets: dict[int, _Bucket] = {}
        self._readings: dict[str, tuple[float, int]] = {}
        """Runner id → (time, tokens_generated) at its last reading."""

    def _index(self, now: float) -> int:
        return math.floor(now / self.bucket_s)

    def _bucket(self, index: int) -> _Bucket:
        bucket = self._buckets.get(index)
        if bucket is None:
            bucket = self._buckets[index] = _Bucket()
            oldest = index - self.buckets
            for old in [i for i in self._buckets if i <= oldest]:
                del self._buckets[old]
        return bucket

    def first_token(self, model: str, runner: str, seconds: float, now: float) -> None:
        bucket = self._bucket(self._index(now))
        bucket.ttft.setdefault(("model", model), []).append(seconds)
        bucket.ttft.setdefault(("runner", runner), []).append(seconds)

    def observe_runners(self, now: float, runners: Iterable[RunnerReading]) -> None:
        seen = set()
        for runner in runners:
            seen.add(runner.id)
            then, before = self._readings.get(runner.id, (now, runner.tokens_generated))
            self._readings[runner.id] = (now, runner.tokens_generated)
            generated = runner.tokens_generated - before
            if generated <= 0:
                continue
            keys = [("runner", runner.name)]
            keys += [("model", model) for model in runner.models]
            shares = [1.0] + [1.0 / len(runner.models)] * len(runner.models)
            for index, part in self._spread(then, now):
                bucket = self._bucket(index)
                for key, share in zip(keys, shares, strict=True):
                    bucket.tokens[key] = bucket.tokens.get(key, 0.0) + generated * part * share
        for gone in set(self._readings) - seen:
            del self._readings[gone]

    def _spread(self, start: float, end: float) -> list[tuple[int, float]]:
        """The buckets the interval covers, each with its share of it; the share of buckets
        older than those kept is dropped."""
        first, last = self._index(start), self._index(end)
        if first == last or end <= start:
            return [(last, 1.0)]
        parts = []
        for index in range(max(first, last - self.buckets + 1), last + 1):
            low = max(start, index * self.bucket_s)
            high = min(end, (index + 1) * self.bucket_s)
            if high > low:
                parts.append((index, (high - low) / (end - start)))
        return parts

    def view(self, now: float) -> dict[str, Any]:
        """The series for `pool.state`: per runner and per model, `tokens_per_second`,
        `ttft_p50_ms` and `ttft_p99_ms` (None where a bucket had no first token), one value
        per bucket, the current (partial) bucket last."""
        last = self._index(now)
        indices = range(last - self.buckets + 1, last + 1)
        names: dict[str, set[str]] = {"runner": set(), "model": set()}
        for index in indices:
            bucket = self._buckets.get(index)
            if bucket is not None:
                for kind, name in (*bucket.tokens, *bucket.ttft):
                    names[kind].add(name)
        elapsed = now - last * self.bucket_s
        out: dict[str, Any] = {"bucket_seconds": self.bucket_s}
        for kind in ("runner", "model"):
            out[f"{kind}s"] = {
                name: self._series((kind, name), indices, last, elapsed)
                for name in sorted(names[kind])
            }
        return out

    def _series(
        self, key: tuple[str, str], indices: range, last: int, elapsed: float
    ) -> dict[str, list[float | None]]:
        rates: list[float | None] = []
        p50: list[float | None] = []
        p99: list[float | None] = []
        for index in indices:
            bucket = self._buckets.get(index)
            seconds = max(elapsed, 1.0) if index == last else self.bucket_s
            tokens = bucket.tokens.get(key, 0.0) if bucket is not None else 0.0
            rates.append(round(tokens / seconds, 1))
            samples = sorted(bucket.ttft.get(key, ())) if bucket is not None else []
            p50.append(_percentile_ms(samples, 0.5))
            p99.append(_percentile_ms(samples, 0.99))
        return {"tokens_per_second": rates, "ttft_p50_ms": p50, "ttft_p99_ms": p99}


def _percentile_ms(ordered: list[float], q: float) -> float | None:
    """The nearest-rank percentile of sorted seconds, in ms; None for no samples."""
    if not ordered:
        return None
    rank = max(1, math.ceil(q * len(ordered)))
    return round(ordered[rank - 1] * 1000, 1)
