"""The quantized KV cache (`--kv-bits`) on a real model whose cache mlx-lm can quantize, both mlx
engines: a request's quantized cache is kept in the prefix cache and reused exactly, survives
the disk tier, counts its quantized bytes in the KV budget, and the batch (whose rows mlx-lm
cannot quantize) serves quantized caches handed to it without failing a row."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from protocol.frames import Generate, Message
from runner.engine.batched import batched_engine
from runner.engine.kv_quant import dequantized, is_quantized, quantized
from runner.engine.kv_store import KvStore
from runner.engine.mlx_engine import MlxEngine
from runner.engine.prefix_cache import BLOCK, KVCache, PrefixCache, QuantizedKVCache, common_prefix
from runner.model_options import ModelOptions
from tests.runner.collect import Collector, engine_starter, final, outputs, run
from tests.runner.engines import GREEDY, MLX_ENGINES, Reference
from tests.runner.kv_model import build_kv_model

SYSTEM = " ".join(f"Rule {i}: answer about orchards, briefly and kindly." for i in range(8))
QUANTIZED = ModelOptions(kv_bits=8, quantized_kv_start=0)
KV_OPTIONS = {"kv_bits": 8, "kv_group_size": 64, "quantized_kv_start": 0}

StartEngine = Callable[..., tuple[MlxEngine, Collector]]


@pytest.fixture(scope="module")
def kv_model(demo_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_kv_model(demo_model_path, tmp_path_factory.mktemp("kv-model") / "kv-tiny")


@pytest.fixture(scope="module")
def kv_reference(kv_model: Path) -> Reference:
    return Reference(kv_model)


@pytest.fixture(params=list(MLX_ENGINES))
def start_engine(request: pytest.FixtureRequest, kv_model: Path) -> Iterator[StartEngine]:
    kind = MLX_ENGINES[request.param]

    def make(**options: Any) -> MlxEngine:
        options.setdefault("options", QUANTIZED)
        return kind(str(kv_model), 8, path=str(kv_model), **options)

    with engine_starter(make) as start:
        yield start


def chat(model: Path, request_id: str, user: str, max_tokens: int = 6) -> Generate:
    return Generate(
        request_id,
        str(model),
        (Message("system", SYSTEM), Message("user", user)),
        max_tokens=max_tokens,
        sampling=GREEDY,
    )


def kept_tokens(engine: MlxEngine, reference: Reference, request: Generate) -> list[int]:
    """What the prefix cache keeps of a finished request: its prompt and its answer, but the
    last token where that never ran through the model (checked against the one entry)."""
    answer = list(dict(engine.stats.recent_tokens)[request.request_id])
    whole = reference.prompt(request) + answer
    entry = next(e for e in prefix_of(engine).entries() if e.tokens == whole[: len(e.tokens)])
    assert len(whole) - 1 <= len(entry.tokens) <= len(whole)
    return entry.tokens


def prefix_of(engine: MlxEngine) -> PrefixCache:
    assert engine._generation is not None
    return engine._generation.prefix_cache


def test_a_quantized_cache_is_kept_and_reused_exactly(
    start_engine: StartEngine, kv_model: Path, kv_reference: Reference
) -> None:
    engine, collector = start_engine()
    first = chat(kv_model, "first", "Hello")
    usage = final(run(engine, collector, first)).usage
    assert (usage.prompt_tokens, usage.cached_tokens) == (len(kv_reference.prompt(first)), 0)
    (entry,) = prefix_of(engine).entries()
    kept = kept_tokens(engine, kv_reference, first)
    assert entry.cache is not None
    assert all(type(layer) is QuantizedKVCache for layer in entry.cache)
    assert [(c.bits, c.group_size, c.offset) for c in entry.cache] == [(8, 64, len(kept))] * 2

    follow = chat(kv_model, "follow", "Hello again")
    events = run(engine, collector, follow)
    prompt = kv_reference.prompt(follow)
    usage = final(events).usage
    assert usage.prompt_tokens == len(prompt)
    assert usage.cached_tokens == common_prefix(kept, prompt) > len(SYSTEM) // 8
    assert usage.completion_tokens == len(outputs(events)) == 6


def test_the_budget_counts_the_quantized_bytes(start_engine: StartEngine, kv_model: Path) -> None:
    sizes = {}
    for name, options in (("plain", ModelOptions()), ("quantized", QUANTIZED)):
        engine, collector = start_engine(options=options)
        run(engine, collector, chat(kv_model, name, "Hello", max_tokens=4))
        prefix = prefix_of(engine)
        (entry,) = prefix.entries()
        assert entry.cache is not None
        assert prefix.nbytes == entry.nbytes == sum(int(c.nbytes) for c in entry.cache)
        assert engine.kv_usage().prefix_bytes == entry.nbytes
        sizes[name] = entry.nbytes
    # 8 bits and a float32 scale and bias per 64 values, against 32 bits a value.
    assert sizes["quantized"] == sizes["plain"] * (8 + 2 * 32 / 64) // 32


def test_a_quantized_cache_survives_the_disk_tier(
    start_engine: StartEngine, kv_model: Path, kv_reference: Reference, tmp_path: Path
) -> None:
    store = KvStore(tmp_path / "kv", 1 << 30)
    try:
        engine, collector = start_engine(kv_store=store)
        first = chat(kv_model, "before", "Hello")
        run(engine, collector, first)
        kept = kept_tokens(engine, kv_reference, first)
        (entry,) = prefix_of(engine).entries()
        assert entry.cache is not None
        written = [mx.array(a) for c in entry.cache for a in (*c.keys, *c.values)]
        store.flush()
        engine.close()

        again, collector = start_engine(kv_store=store)  # a runner restart
        assert prefix_of(again).on_disk == 1
        follow = chat(kv_model, "after", "Hello")
        events = run(again, collector, follow)
        usage, stats = final(events).usage, final(events).stats
        assert common_prefix(kept, kv_reference.prompt(follow)) == usage.prompt_tokens
        assert usage.cached_tokens == usage.prompt_tokens - 1
        assert stats is not None
        assert stats.cached_disk_tokens == usage.cached_tokens
        # What came back is what was written, bit for bit, and still quantized.
        read = next(e for e in prefix_of(again).entries() if e.tokens == kept)
        assert read.cache is not None
        assert all(type(layer) is QuantizedKVCache for layer in read.cache)
        back = [a for c in read.cache for a in (*c.keys, *c.values)]
        assert len(back) == len(written)
        for old, new in zip(written, back, strict=True):
            assert mx.array_equal(old[..., : len(kept), :], new[..., : len(kept), :]).item()
    finally:
        store.close()


def test_concurrent_quantized_requests_run_in_the_batch(
    kv_model: Path, kv_reference: Reference
) -> None:
    with engine_starter(
        lambda: batched_engine(str(kv_model), 8, path=str(kv_model), options=QUANTIZED)
    ) as start:
        engine, collector = start()
        # Alone, the first runs on a quantized lone cache; the others make it hand over to
        # the batch, which cannot merge a quantized cache.
        lone = chat(kv_model, "lone", "Tell me a long story.", max_tokens=40)
        engine.submit(lone)
        collector.wait_for_outputs("lone", 3)
        others = [chat(kv_model, f"row{i}", f"Question {i}?", max_tokens=12) for i in range(4)]
        for request in others:
            engine.submit(request)
        for request in [lone, *others]:
            events = collector.wait(request.request_id)
            usage = final(events).usage
            assert usage.prompt_tokens == len(kv_reference.prompt(request))
            assert usage.completion_tokens == len(outputs(events)) == request.max_tokens
        assert engine.stats.solo_requests == 1
        assert engine.stats.batched_requests == 5
        # Every row's cache came back from the batch quantized, to be kept.
        entries = prefix_of(engine).entries()
        assert len(entries) == 5
        assert all(e.cache is not None and is_quantized(e.cache) for e in entries)
        # And a later row starts from a kept, quantized prompt.
        again = chat(kv_model, "again", "Question 0?", max_tokens=12)
        usage = final(run(engine, collector, again)).usage
        assert usage.cached_tokens == usage.prompt_tokens - 1


def test_dequantized_holds_what_the_quantized_cache_reads() -> None:
    plain = KVCache()
    data = mx.random.normal((1, 2, 70, 64), key=mx.random.key(0))
    plain.update_and_fetch(data, data)
    (small,) = quantized([plain], KV_OPTIONS)
    assert type(small) is QuantizedKVCache
    assert small.offset == 70
    (back,) = dequantized([small])
    assert type(back) is KVCache
    assert back.offset == 70
    assert back.keys.shape == (1, 2, 70, 64)
    weights, scales, biases = (a[..., :70, :] for a in small.keys)
    expected = mx.dequantize(weights, scales, biases, group_size=64, bits=8)
    assert mx.array_equal(back.keys, expected).item()
    assert mx.all(mx.abs(back.keys - data) < 0.05).item()  # 8 bits of a unit normal
    # Below quantized_kv_start a cache stays plain; without options, nothing changes.
    assert quantized([plain], {**KV_OPTIONS, "quantized_kv_start": 71}) == [plain]
    assert quantized([plain], {}) == [plain]


def test_a_quantized_entry_is_cut_back_to_its_reused_head() -> None:
    plain = KVCache()
    data = mx.random.normal((1, 1, 3 * BLOCK, 64), key=mx.random.key(1))
    plain.update_and_fetch(data, data)
    cache = quantized([plain], KV_OPTIONS)
    prefix = PrefixCache()
    prompt = list(range(3 * BLOCK))
    prefix.put(prompt, cache)
    view, length = prefix.take([*prompt[:BLOCK], 9999])
    assert length == BLOCK
    assert view is not None
    assert is_quantized(view)
    assert prefix.evict_oldest()  # cut to the head that was reused, not dropped
    (entry,) = prefix.entries()
    assert entry.head
    assert entry.tokens == prompt[:BLOCK]
    assert entry.cache is not None
    assert is_quantized(entry.cache)
    assert entry.cache[0].keys[0].shape[2] == BLOCK
    assert entry.nbytes == sum(
        int(a.nbytes) for a in (*entry.cache[0].keys, *entry.cache[0].values)
    )
