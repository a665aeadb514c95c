"""An Engine on mlx-lm: one generation thread serves every request, a token each in turn.

MLX arrays, the model and its KV caches belong to the thread that made them, so `MlxEngine`
loads the model on its own generation thread (a `ThreadedEngine`) and touches MLX nowhere
else. For each request the generation thread:

1. on intake, applies the chat template and checks the lengths (`mlx_model.MlxModel`), so
   errors come at once and a cancelled queued request still reports its real prompt usage;
2. when one of the `max_concurrent` slots is free, starts it on its decoding strategy, from
   the prefix cache's longest match for its prompt;
3. advances every running request by one token per step, routes each token through
   `runner.accounting.RequestAccounting` and emits one `Output` per token
   (`generation.Generation`);
4. at the end keeps the request's KV cache in the prefix cache for the requests after it.

`MlxEngine` decodes interleaved (`interleaved.InterleavedDecoder`: one `stream_generate` per
request, round robin); `batched.BatchedMlxEngine` swaps in batched decoding.
"""

from __future__ import annotations

import collections
import logging
from importlib.metadata import version

import mlx.core as mx

from protocol.frames import ModelInfo
from runner.engine.generation import Generation, Stepping
from runner.engine.interleaved import InterleavedDecoder
from runner.engine.mlx_model import MlxModel
from runner.engine.prefix_cache import PrefixCache
from runner.engine.threaded import AT_ONCE, Submit, ThreadedEngine

log = logging.getLogger("runner.engine")


class MlxEngine(ThreadedEngine):
    """Serves one mlx-lm model (a local MLX directory, a Hugging Face id or "orchard-demo").

    Counters for tests and metrics are plain attributes, written by the generation thread:
    `tokens_generated`, `requests_finished` (terminal events of any kind), `active_requests`,
    `waiting_requests`, `peak_active_requests`, `prefix_cache_hits`; and `recent_tokens`, the
    generated token ids of the last few requests that finished (for exact-output tests).
    """

    def __init__(
        self,
        model: str,
        max_concurrent: int = 4,
        *,
        prefix_cache_size: int = 8,
        context_length: int | None = None,
        close_timeout: float = 30.0,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, not {max_concurrent}")
        super().__init__(thread_name=f"mlx-engine:{model}", close_timeout=close_timeout)
        self.model_name = model
        self.max_concurrent = max_concurrent
        self.prefix_cache_size = prefix_cache_size
        self._context_length = context_length
        # The generation thread's own state, made by _load.
        self._generation: Generation | None = None
        self._stepping: Stepping | None = None

        self.tokens_generated = 0
        self.requests_finished = 0
        self.active_requests = 0
        self.waiting_requests = 0
        self.peak_active_requests = 0
        self.prefix_cache_hits = 0
        self.recent_tokens: collections.deque[tuple[str, tuple[int, ...]]] = collections.deque(
            maxlen=32
        )

    def _make_stepping(self, generation: Generation) -> Stepping:
        """The decoding strategy, made on the generation thread once the model is loaded."""
        return InterleavedDecoder(generation)

    # The generation thread.

    def _load(self) -> None:
        assert self._sink is not None
        model = MlxModel.load(self.model_name, context_length=self._context_length)
        generation = Generation(
            model,
            sink=self._sink,
            counters=self,
            max_concurrent=self.max_concurrent,
            prefix_cache=PrefixCache(self.prefix_cache_size),
        )
        self._stepping = self._make_stepping(generation)
        self._generation = generation
        self._models = (ModelInfo(self.model_name, model.context_length, engine_version()),)
        log.info(
            "loaded %s (context %d tokens, %s)",
            self.model_name,
            model.context_length,
            type(self._stepping).__name__,
        )

    def _next_step_at(self, pending: bool) -> float | None:
        assert self._generation is not None
        return AT_ONCE if pending or self._generation.busy else None

    def _step(self, now: float, submits: list[Submit], cancels: list[str]) -> None:
        generation, stepping = self._generation, self._stepping
        assert generation is not None
        assert stepping is not None
        for request, submitted_at in submits:
            generation.intake(request, submitted_at, stepping.check)
        for request_id in cancels:
            generation.cancel(request_id)
        generation.admit(stepping.place)
        stepping.step()

    def _thread_exit(self) -> None:
        try:
            if self._stepping is not None:
                self._stepping.drop_all()
            if self._generation is not None:
                self._generation.drop_all()
        finally:
            # MLX 0.32 aborts the process at exit ("terminate called without an active
            # exception") unless a thread that used MLX destroys its streams before it ends.
            mx.clear_streams()


def engine_version() -> str:
    """What generates here, for clients' `system_fingerprint`: library versions and device."""
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    return f"mlx-lm {version('mlx-lm')}, mlx {version('mlx')}, {device}"
