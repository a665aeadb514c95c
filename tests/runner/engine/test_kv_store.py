"""The disk tier (runner.engine.kv_store) with a PrefixCache over it, on real files and real
mlx-lm KV caches: written and read back, found again by a new store (a restart), bounded
and least recently used out, and never loading what it did not write whole."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from runner.engine import kv_store
from runner.engine.cache_entry import Entry
from runner.engine.kv_store import DATA, SUM, KvStore, Loaded, ModelStore, model_identity
from runner.engine.prefix_cache import BLOCK, PrefixCache
from tests.runner.caches import filled, held, nbytes, tokens
from tests.support import wait_until

MODEL = "org_model-0123456789abcdef"  # as model_identity names one


def settle(prefix: PrefixCache, store: ModelStore) -> None:
    """Hand what the store's threads finished to the prefix cache (what the engine does
    between steps), once every write queued so far is done."""
    store.store.flush()
    apply(prefix, store)


def apply(prefix: PrefixCache, store: ModelStore) -> None:
    for done in store.completions():
        prefix.apply(done)


def files(directory: Path) -> list[str]:
    return sorted(p.suffix for p in directory.iterdir())


@pytest.fixture
def store(tmp_path: Path) -> KvStore:
    return KvStore(tmp_path / "kv", 1 << 30)


def test_an_entry_is_written_and_found_again_by_a_new_store(store: KvStore, tmp_path: Path) -> None:
    model = store.for_model(MODEL)
    prefix = PrefixCache(store=model)
    prompt = tokens(2 * BLOCK + 3)
    prefix.put(prompt, filled(len(prompt), value=0.25), ("h1", "h2"))
    settle(prefix, model)
    (entry,) = prefix.entries()
    assert entry.stored is not None
    assert files(model.directory) == [DATA, SUM]
    store.close()

    # A restart: the entry is known at once, on disk only, and so are its prefix hashes.
    again = KvStore(tmp_path / "kv", 1 << 30)
    reloaded = again.for_model(MODEL)
    fresh = PrefixCache(store=reloaded)
    assert (len(fresh), fresh.on_disk) == (0, 1)
    assert sorted(fresh.chains()) == ["h1", "h2"]
    found = fresh.match([*prompt, 7])
    assert found is not None
    assert (found.length, found.entry.in_memory) == (len(prompt), False)
    assert fresh.load(found.entry)
    wait_until(lambda: bool(reloaded._done), 10, "the read")
    assert fresh.poll()
    cache, reused = fresh.take([*prompt, 7])
    assert reused == len(prompt)
    assert cache is not None
    assert held(cache) == [0.25 + i for i in range(len(prompt))]
    again.close()


def test_bad_files_are_discarded_and_never_loaded(store: KvStore, tmp_path: Path) -> None:
    model = store.for_model(MODEL)
    prefix = PrefixCache(store=model)
    for i in range(4):
        prefix.put(tokens(BLOCK, start=1000 * i), filled(BLOCK))
    settle(prefix, model)
    data = sorted(model.directory.glob(f"*{DATA}"))
    assert len(data) == 4
    corrupt, truncated, unsummed, foreign = data
    with corrupt.open("r+b") as f:  # one byte of the arrays changed
        f.seek(-10, 2)
        byte = f.read(1)
        f.seek(-10, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    with truncated.open("r+b") as f:
        f.truncate(corrupt.stat().st_size // 2)
    unsummed.with_suffix(SUM).unlink()  # a write cut short before its checksum
    other = store.for_model("another_model-0123456789abcdef")
    other.directory.mkdir(parents=True)
    shutil.move(foreign, other.directory / foreign.name)  # another model's file, misplaced
    shutil.move(foreign.with_suffix(SUM), other.directory / foreign.with_suffix(SUM).name)
    (model.directory / "notes.txt").write_text("not ours")
    stale, live = (
        model.directory / ".old.1.2.safetensors",
        model.directory / ".new.3.4.safetensors",
    )
    stale.write_bytes(b"cut short")
    live.write_bytes(b"another runner is writing this")
    old = stale.stat().st_mtime - 2 * kv_store.STALE_STAGING
    os.utime(stale, (old, old))
    store.close()

    again = KvStore(tmp_path / "kv", 1 << 30)
    reloaded = again.for_model(MODEL)
    fresh = PrefixCache(store=reloaded)
    # The header scan drops what has no checksum (and what is not ours) at once...
    assert fresh.on_disk == 2
    assert not (model.directory / "notes.txt").exists()
    assert not stale.exists()  # a write cut short long ago
    assert live.exists()  # one under way: left alone
    # ... and a read drops what does not hash to its checksum.
    for entry in fresh.entries():
        assert fresh.load(entry)
    wait_until(lambda: len(reloaded._done) >= 2, 10, "both reads")
    results = reloaded.completions()
    assert sorted(type(r).__name__ for r in results) == ["Loaded", "Loaded"]
    assert all(isinstance(r, Loaded) and r.cache is None for r in results)
    for r in results:
        fresh.apply(r)
    assert (len(fresh), fresh.on_disk) == (0, 0)
    assert list(model.directory.iterdir()) == [live]
    # The misplaced file names another model: that model's store discards it too.
    assert PrefixCache(store=again.for_model("another_model-0123456789abcdef")).on_disk == 0
    assert list(other.directory.iterdir()) == []
    again.close()


def test_the_budget_holds_least_recently_used_out(tmp_path: Path) -> None:
    probe = KvStore(tmp_path / "probe", 1 << 30)
    probe_model = probe.for_model(MODEL)
    probe_prefix = PrefixCache(store=probe_model)
    probe_prefix.put(tokens(BLOCK), filled(BLOCK))
    settle(probe_prefix, probe_model)
    one = probe.nbytes
    probe.close()

    store = KvStore(tmp_path / "kv", 2 * one + one // 2)
    model = store.for_model(MODEL)
    prefix = PrefixCache(store=model)
    for i in range(3):
        prefix.put(tokens(BLOCK, start=1000 * i), filled(BLOCK))
        settle(prefix, model)
    assert store.nbytes <= 2 * one + one // 2
    stored = sorted(e.tokens[0] for e in prefix.entries() if e.stored is not None)
    assert stored == [1000, 2000]  # the oldest file went; its entry lives on in memory
    assert len(prefix) == 3
    prefix.make_room(0)  # out of memory: what has a file stays known, on disk
    assert (len(prefix), prefix.on_disk) == (0, 2)
    store.close()


def test_evicted_from_memory_it_is_read_back_on_a_hit(store: KvStore) -> None:
    model = store.for_model(MODEL)
    size = nbytes(filled(BLOCK))
    prefix = PrefixCache(max_bytes=size, store=model)
    a, b = tokens(BLOCK), tokens(BLOCK, start=1000)
    prefix.put(a, filled(BLOCK, value=0.5))
    settle(prefix, model)
    prefix.put(b, filled(BLOCK))  # a leaves memory, to disk
    settle(prefix, model)
    assert prefix.take([*a, 1]) == (None, 0)  # not in memory...
    found = prefix.match([*a, 1])
    assert found is not None  # ... but on disk
    assert (found.length, found.entry.in_memory) == (BLOCK, False)
    assert prefix.load(found.entry)
    wait_until(lambda: bool(model._done), 10, "the read")
    assert prefix.poll()
    cache, reused = prefix.take([*a, 1])
    assert reused == BLOCK
    assert cache is not None
    assert held(cache)[:2] == [0.5, 1.5]
    assert len(prefix) == 1  # b made room for it
    store.close()


@pytest.mark.parametrize("why", [errno.ENOSPC, errno.EACCES])
def test_a_full_or_unwritable_disk_warns_once_and_goes_on_in_memory(
    store: KvStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, why: int
) -> None:
    import mlx_lm.models.cache

    def fail(*args: Any, **kwargs: Any) -> None:
        raise OSError(why, "simulated")

    monkeypatch.setattr(mlx_lm.models.cache, "save_prompt_cache", fail)
    model = store.for_model(MODEL)
    prefix = PrefixCache(store=model)
    with caplog.at_level(logging.WARNING, "runner.engine.kv_store"):
        for i in range(3):
            prefix.put(tokens(BLOCK, start=1000 * i), filled(BLOCK))
            settle(prefix, model)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "disk KV cache off, going on in memory only" in warnings[0].getMessage()
    assert not store.enabled
    assert len(prefix) == 3  # served from memory as before
    assert all(e.stored is None and not e.storing for e in prefix.entries())
    store.close()


def test_an_unusable_directory_means_memory_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the directory should be")
    with caplog.at_level(logging.WARNING, "runner.engine.kv_store"):
        store = KvStore(blocker / "kv", 1 << 30)
    assert not store.enabled
    assert "disk KV cache off" in caplog.text
    model = store.for_model(MODEL)
    prefix = PrefixCache(store=model)
    prefix.put(tokens(8), filled(8))
    apply(prefix, model)
    assert len(prefix) == 1
    store.close()


def test_the_identity_changes_with_the_weights(tmp_path: Path) -> None:
    directory = tmp_path / "m"
    directory.mkdir()
    (directory / "config.json").write_text('{"a": 1}')
    (directory / "model.safetensors").write_bytes(b"x" * 100)
    first = model_identity("org/m", directory)
    assert first == model_identity("org/m", directory)
    assert first.startswith("org_m-")
    assert model_identity("org/other", directory) != first
    (directory / "model.safetensors").write_bytes(b"y" * 101)
    assert model_identity("org/m", directory) != first
    (directory / "model.safetensors").write_bytes(b"x" * 100)
    (directory / "config.json").write_text('{"a": 2}')
    assert model_identity("org/m", directory) != first


def test_files_of_changed_weights_are_never_read(store: KvStore, tmp_path: Path) -> None:
    old = store.for_model("org_m-0000000000000000")
    prefix = PrefixCache(store=old)
    prefix.put(tokens(BLOCK), filled(BLOCK))
    settle(prefix, old)
    new = store.for_model("org_m-1111111111111111")
    assert PrefixCache(store=new).on_disk == 0
    assert store.nbytes > 0  # the old files count until the budget pushes them out


def test_default_budget_is_a_share_of_the_free_disk(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    budget = kv_store.default_budget(tmp_path / "not" / "made" / "yet")
    assert budget == int(min(free * kv_store.DEFAULT_SHARE, kv_store.DEFAULT_CAP))
    assert budget > 0


def test_an_entry_dropped_while_written_leaves_no_file(store: KvStore) -> None:
    model = store.for_model(MODEL)
    prefix = PrefixCache(store=model)
    turn1 = tokens(BLOCK)
    prefix.put(turn1, filled(BLOCK))
    (first,) = prefix.entries()
    assert isinstance(first, Entry)
    assert first.storing
    turn2 = [*turn1, *tokens(BLOCK, start=500)]
    prefix.put(turn2, filled(len(turn2)))  # holds turn1: that entry is dropped at once
    settle(prefix, model)  # turn1's write completes after its entry went: its file goes
    store.flush()
    (entry,) = prefix.entries()
    assert entry.tokens == turn2
    assert entry.stored is not None
    assert sorted(model.directory.glob(f"*{DATA}")) == [entry.stored.path]
    store.close()
