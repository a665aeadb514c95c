"""ModelShelf: several models on one runner, loaded on demand within a memory budget.

The models here are scripted engines from a scripted source (sizes, downloads and failures
chosen per test), so that each rule of the shelf is checked exactly and fast; the real path
(mlx-lm models, the gateway, the Hub) is tests/e2e/test_models_on_demand.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from protocol.frames import Download, Generate, Message, ModelInfo, Usage
from runner.engine.base import Engine, EngineEvent, Failure, Output
from runner.engine.scripted import ScriptedEngine, scripted_prompt_tokens
from runner.engine.shelf import ModelShelf, Progress
from runner.errors import EngineStateError, ModelLoadError
from tests.runner.collect import Collector, outputs
from tests.support import UNIT

GIB = 2**30


class Source:
    """A scripted `ModelSource`: `sizes` says each model's size; models in `remote` are not on
    disk until fetched, with a download of `chunks` progress steps; `broken` ones fail."""

    def __init__(
        self,
        sizes: dict[str, int],
        *,
        remote: frozenset[str] = frozenset(),
        broken: dict[str, str] | None = None,
        chunks: int = 4,
    ) -> None:
        self.sizes = sizes
        self.remote = set(remote)
        self.broken = broken or {}
        self.chunks = chunks
        self.fetches: list[str] = []
        self.gate = threading.Event()
        """Set: fetches go on at once; clear: they wait for it (a slow download)."""
        self.gate.set()

    def on_disk(self, name: str) -> str | None:
        return None if name in self.remote or name in self.broken else f"/models/{name}"

    def fetch(self, name: str, progress: Progress) -> str:
        self.fetches.append(name)
        if name in self.broken:
            raise OSError(self.broken[name])
        if name in self.remote:
            total = self.sizes[name]
            for step in range(1, self.chunks + 1):
                assert self.gate.wait(10 * UNIT)
                progress(total * step // self.chunks, total)
            self.remote.discard(name)
        return f"/models/{name}"

    def size(self, path: str) -> int:
        return self.sizes[path.removeprefix("/models/")]


class Shelf:
    """A started shelf, its collector, its watcher's log and the engines it made."""

    def __init__(self, shelf: ModelShelf, collector: Collector) -> None:
        self.shelf = shelf
        self.collector = collector
        self.changes: list[ModelInfo] = []
        self.engines: dict[str, list[ScriptedEngine]] = {}
        self.made_at: dict[str, float] = {}
        """When each model's (last) engine was made."""
        self.ended_at: dict[str, float] = {}
        """When each request's terminal event came."""
        collector.on_event = self._on_event

    def _on_event(self, event: EngineEvent) -> None:
        if isinstance(event, Failure) or event.finish_reason is not None:
            self.ended_at[event.request_id] = time.monotonic()


MakeShelf = Callable[..., Shelf]


@pytest.fixture
def make_shelf() -> Iterator[MakeShelf]:
    made: list[ModelShelf] = []

    def make(
        source: Source, models: tuple[str, ...], budget: int, tokens_per_second: float = 0.0
    ) -> Shelf:
        collector = Collector()
        holder: list[Shelf] = []

        def make_engine(name: str, path: str) -> Engine:
            assert path == f"/models/{name}"
            engine = ScriptedEngine(
                (name,), tokens_per_second=tokens_per_second, default_max_tokens=3
            )
            holder[0].engines.setdefault(name, []).append(engine)
            holder[0].made_at[name] = time.monotonic()
            return engine

        shelf = ModelShelf(models, make_engine=make_engine, source=source, max_memory=budget)
        made.append(shelf)
        result = Shelf(shelf, collector)
        holder.append(result)
        shelf.watch_models(result.changes.append)
        shelf.start(collector)
        return result

    yield make
    for shelf in made:
        shelf.close()


def ask(request_id: str, model: str, max_tokens: int = 3) -> Generate:
    return Generate(request_id, model, (Message("user", "hi there"),), max_tokens=max_tokens)


def states(shelf: ModelShelf) -> dict[str, str]:
    return {info.id: info.state for info in shelf.models}


def wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10 * UNIT
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_first_model_loads_at_start_and_the_others_wait_for_a_request(
    make_shelf: MakeShelf,
) -> None:
    source = Source({"a": GIB, "b": 2 * GIB}, remote=frozenset({"b"}))
    s = make_shelf(source, ("a", "b"), 8 * GIB)
    assert states(s.shelf) == {"a": "loaded", "b": "loadable"}
    a, b = s.shelf.models
    assert a.size_bytes == GIB  # on disk: sized before any load
    assert b.size_bytes is None  # not downloaded yet: not known
    assert s.shelf.loaded_bytes == GIB
    assert source.fetches == ["a"]
    assert s.changes[-1].state == "loaded"
    assert s.changes[-1].id == "a"


def test_a_request_for_a_loadable_model_downloads_loads_and_runs_it(make_shelf: MakeShelf) -> None:
    source = Source({"a": GIB, "b": 4000}, remote=frozenset({"b"}), chunks=4)
    s = make_shelf(source, ("a", "b"), 8 * GIB)
    source.gate.clear()
    s.shelf.submit(ask("r1", "b"))
    wait_for(lambda: states(s.shelf)["b"] == "loading", "b loading")
    source.gate.set()
    events = outputs(s.collector.wait("r1"))
    assert "".join(e.text for e in events) == "tok0 tok1 tok2 "
    assert events[-1].usage == Usage(scripted_prompt_tokens(ask("r1", "b").messages), 3)
    assert states(s.shelf) == {"a": "loaded", "b": "loaded"}
    b_changes = [c for c in s.changes if c.id == "b"]
    downloads = [c.download for c in b_changes if c.download is not None]
    # Progress goes up and ends at the whole download (reports are at most every 0.5 s,
    # the last one always).
    assert downloads[-1] == Download(4000, 4000)
    assert [d.done_bytes for d in downloads] == sorted(d.done_bytes for d in downloads)
    assert b_changes[-1] == ModelInfo("b", 4096, state="loaded", size_bytes=4000)
    assert b_changes[0].state == "loading"


def test_the_least_recently_used_idle_model_makes_room(make_shelf: MakeShelf) -> None:
    source = Source({"a": 3 * GIB, "b": 3 * GIB, "c": 3 * GIB})
    s = make_shelf(source, ("a", "b", "c"), 7 * GIB)  # two fit
    s.shelf.submit(ask("r1", "b"))
    s.collector.wait("r1")
    s.shelf.submit(ask("r2", "a"))  # a is now used after b
    s.collector.wait("r2")
    s.shelf.submit(ask("r3", "c"))
    s.collector.wait("r3")
    assert states(s.shelf) == {"a": "loaded", "b": "loadable", "c": "loaded"}
    assert s.shelf.unloads == 1
    assert s.shelf.loaded_bytes == 6 * GIB
    (b_engine,) = s.engines["b"]
    assert b_engine._thread is not None
    assert not b_engine._thread.is_alive()
    # b comes back when asked for, in place of the least recently used: a (r2 came before r3).
    s.shelf.submit(ask("r4", "b"))
    assert outputs(s.collector.wait("r4"))[-1].finish_reason == "length"
    assert states(s.shelf) == {"a": "loadable", "b": "loaded", "c": "loaded"}
    assert len(s.engines["b"]) == 2


def test_a_busy_model_is_not_unloaded_the_load_waits_for_it(make_shelf: MakeShelf) -> None:
    source = Source({"a": 3 * GIB, "b": 3 * GIB})
    s = make_shelf(source, ("a", "b"), 4 * GIB, tokens_per_second=50)  # one fits
    s.shelf.submit(ask("long", "a", max_tokens=20))  # about 0.4 s
    s.collector.wait_for_outputs("long", 1)
    s.shelf.submit(ask("next", "b"))
    long_events = s.collector.wait("long")
    assert outputs(long_events)[-1].tokens == 1
    assert len(long_events) == 20
    next_events = outputs(s.collector.wait("next"))
    assert "".join(e.text for e in next_events) == "tok0 tok1 tok2 "
    assert states(s.shelf) == {"a": "loadable", "b": "loaded"}
    # b was loaded only once a was idle: a's request ended before b's engine was made.
    assert s.ended_at["long"] < s.made_at["b"] < s.ended_at["next"]


def test_a_busy_model_cannot_keep_another_out(make_shelf: MakeShelf) -> None:
    # One fits. While a waits to be unloaded for b, new requests for a wait too (behind b),
    # instead of keeping a busy for ever; then a is loaded again for them.
    source = Source({"a": 3 * GIB, "b": 3 * GIB})
    s = make_shelf(source, ("a", "b"), 4 * GIB, tokens_per_second=50)
    s.shelf.submit(ask("a1", "a", max_tokens=15))
    s.collector.wait_for_outputs("a1", 1)
    s.shelf.submit(ask("b1", "b"))
    wait_for(lambda: s.shelf._models["a"].evicting, "a marked for eviction")
    s.shelf.submit(ask("a2", "a"))
    for rid in ("a1", "b1", "a2"):
        assert outputs(s.collector.wait(rid))[-1].finish_reason == "length"
    # a2 ran on a's second engine, made after b's, which was made once a1 had ended.
    assert s.ended_at["a1"] < s.made_at["b"] < s.made_at["a"] < s.ended_at["a2"]
    assert s.ended_at["b1"] < s.made_at["a"]
    assert len(s.engines["a"]) == 2
    assert s.engines["a"][0].stats.requests_finished == 1  # a1 only
    assert states(s.shelf) == {"a": "loaded", "b": "loadable"}
    assert s.shelf.unloads == 2


def test_a_model_marked_for_eviction_serves_again_when_room_is_made_otherwise(
    make_shelf: MakeShelf,
) -> None:
    # Two fit; a and b are loaded and busy when c is asked for: a (the least recently used)
    # is marked; b finishes first and goes instead, so a takes its held request at once.
    source = Source({"a": 3 * GIB, "b": 3 * GIB, "c": 3 * GIB})
    s = make_shelf(source, ("a", "b", "c"), 7 * GIB, tokens_per_second=40)
    s.shelf.submit(ask("b0", "b"))
    s.collector.wait("b0")
    s.shelf.submit(ask("a1", "a", max_tokens=60))  # about 1.5 s
    s.shelf.submit(ask("b1", "b", max_tokens=12))  # about 0.3 s
    s.collector.wait_for_outputs("a1", 1)
    s.shelf.submit(ask("c1", "c"))
    wait_for(lambda: s.shelf._models["a"].evicting, "a marked for eviction")
    s.shelf.submit(ask("a2", "a", max_tokens=2))
    for rid in ("a1", "b1", "c1", "a2"):
        assert outputs(s.collector.wait(rid))[-1].finish_reason == "length"
    assert len(s.engines["a"]) == 1  # never unloaded
    assert s.engines["a"][0].stats.requests_finished == 2  # a2 ran on it
    assert not s.shelf._models["a"].evicting
    assert states(s.shelf) == {"a": "loaded", "b": "loadable", "c": "loaded"}


def test_a_model_larger_than_the_budget_fails_its_requests_clearly(make_shelf: MakeShelf) -> None:
    source = Source({"a": GIB, "big": 10 * GIB})
    s = make_shelf(source, ("a", "big"), 8 * GIB)
    s.shelf.submit(ask("r1", "big"))
    (failure,) = s.collector.wait("r1")
    assert failure == Failure(
        "r1",
        "model_load_failed",
        "Could not load big needs 10.0 GiB and this runner's memory budget is 8.0 GiB "
        "(--max-memory).",
    )
    (big,) = [m for m in s.shelf.models if m.id == "big"]
    assert big.state == "loadable"
    assert (
        big.error == "big needs 10.0 GiB and this runner's memory budget is 8.0 GiB (--max-memory)"
    )
    assert states(s.shelf)["a"] == "loaded"  # nothing unloaded for a load that cannot fit
    assert s.shelf.unloads == 0


def test_a_failed_download_fails_the_waiting_requests_and_the_next_one_tries_again(
    make_shelf: MakeShelf,
) -> None:
    source = Source({"a": GIB, "b": GIB}, broken={"b": "Repository not found: b"})
    s = make_shelf(source, ("a", "b"), 8 * GIB)
    source.gate.clear()
    s.shelf.submit(ask("r1", "b"))
    s.shelf.submit(ask("r2", "b"))
    source.gate.set()
    for rid in ("r1", "r2"):
        (failure,) = s.collector.wait(rid)
        assert failure == Failure(
            rid, "model_load_failed", "Could not load b: Repository not found: b."
        )
    assert source.fetches.count("b") == 1  # one load for both
    s.shelf.submit(ask("r3", "b"))
    s.collector.wait("r3")
    assert source.fetches.count("b") == 2  # tried again
    (b,) = [m for m in s.shelf.models if m.id == "b"]
    assert (b.state, b.error) == ("loadable", "b: Repository not found: b")


def test_a_request_cancelled_while_its_model_loads_ends_at_once(make_shelf: MakeShelf) -> None:
    source = Source({"a": GIB, "b": GIB}, remote=frozenset({"b"}))
    s = make_shelf(source, ("a", "b"), 8 * GIB)
    source.gate.clear()
    s.shelf.submit(ask("r1", "b"))
    s.shelf.submit(ask("r2", "b"))
    s.shelf.cancel("r1")
    (cancelled,) = s.collector.wait("r1")
    assert cancelled == Output("r1", "", "", 0, Usage(0, 0), finish_reason="cancelled")
    source.gate.set()
    assert "".join(e.text for e in outputs(s.collector.wait("r2"))) == "tok0 tok1 tok2 "
    assert len(s.collector.events["r1"]) == 1  # nothing after its end


def test_unknown_models_and_wrong_states(make_shelf: MakeShelf) -> None:
    source = Source({"a": GIB})
    s = make_shelf(source, ("a",), 8 * GIB)
    s.shelf.submit(ask("r1", "zzz"))
    assert s.collector.wait("r1") == [
        Failure("r1", "model_not_found", "This runner serves a, not zzz.")
    ]
    with pytest.raises(EngineStateError):
        s.shelf.start(Collector())
    with pytest.raises(EngineStateError):
        ModelShelf(
            ("a",), make_engine=lambda n, p: ScriptedEngine(), source=source, max_memory=1
        ).submit(ask("r2", "a"))
    with pytest.raises(ValueError, match="named twice"):
        ModelShelf(
            ("a", "a"), make_engine=lambda n, p: ScriptedEngine(), source=source, max_memory=1
        )


def test_the_first_model_failing_to_load_fails_start() -> None:
    source = Source({"a": GIB}, broken={"a": "no such directory"})
    shelf = ModelShelf(
        ("a",), make_engine=lambda n, p: ScriptedEngine((n,)), source=source, max_memory=8 * GIB
    )
    with pytest.raises(ModelLoadError, match=r"^a: no such directory$"):
        shelf.start(Collector())


def test_close_while_a_load_waits(make_shelf: MakeShelf) -> None:
    source = Source({"a": GIB, "b": GIB}, remote=frozenset({"b"}))
    s = make_shelf(source, ("a", "b"), 8 * GIB)
    source.gate.clear()
    s.shelf.submit(ask("r1", "b"))
    wait_for(lambda: source.fetches.count("b") == 1, "b fetching")
    closer = threading.Thread(target=s.shelf.close)
    closer.start()
    source.gate.set()
    closer.join(10 * UNIT)
    assert not closer.is_alive()
    assert "b" not in s.engines or not s.engines["b"][0]._thread.is_alive()  # type: ignore[union-attr]
    assert not s.collector.events.get("r1")  # dropped without events, as close says
    s.shelf.submit(ask("r2", "a"))
    assert s.collector.wait("r2") == [Failure("r2", "internal_error", "the engine is closed")]
