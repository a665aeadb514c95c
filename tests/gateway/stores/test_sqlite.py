"""The stores written through to SQLite (gateway.stores.sqlite), with no server: what one
store kept, a store opened again on the file holds (values, order, updates, deletes), its
bounds and expiry applied again at open on the wall clock, concurrent writers, and the one
clear error for a file that cannot be used (not SQLite, damaged, locked, a newer schema)."""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.app import close_app, create_app
from gateway.config import GatewayConfig
from gateway.errors import StoreUnavailable
from gateway.stores.chat import CompletionStore, StoredCompletion
from gateway.stores.responses import ResponseStore, StoredResponse
from gateway.stores.sqlite import SCHEMA_VERSION, Database, lock_path
from protocol.core.errors import ApiError
from protocol.frames import Message, ToolCall
from protocol.openai.chat.request import parse_chat_object
from protocol.openai.chat.stored import StoreRequest, parse_list_query
from protocol.openai.pages import PageQuery


class Clock:
    """A wall clock the test sets."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def request(text: str = "hi") -> StoreRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "store": True}
    stored = parse_chat_object(body, store=True).store
    assert stored is not None
    return stored


def completion(id: str, created: int = 100, text: str = "hello") -> dict[str, Any]:
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
    }


CONVERSATION = (
    Message("system", "Be brief."),
    Message("user", "weather?", name="ann"),
    Message(
        "assistant",
        "",
        tool_calls=(ToolCall("call_1", "weather", '{"city": "Zürich"}'),),
        reasoning="I should look it up.",
    ),
    Message("tool", "Sunny", tool_call_id="call_1"),
    Message("assistant", "Sunny. ☀"),
)


def chats(
    database: Database, clock: Clock, count: int = 100, nbytes: int = 1 << 20, ttl: float = 60
) -> CompletionStore:
    return CompletionStore(
        count, nbytes, ttl, clock, backing=database.table("chat", StoredCompletion)
    )


def responses(database: Database, clock: Clock, count: int = 100) -> ResponseStore:
    return ResponseStore(
        count, 1 << 24, 60, clock, backing=database.table("responses", StoredResponse)
    )


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "store.sqlite3"


def ids(store: CompletionStore) -> list[str]:
    """Every stored completion's id, oldest first (page after page)."""
    found: list[str] = []
    while True:
        after = [("after", found[-1])] if found else []
        listed = orjson.loads(store.list(parse_list_query([("limit", "100"), *after])))
        found += [entry["id"] for entry in listed["data"]]
        if not listed["has_more"]:
            return found


def test_what_was_stored_is_there_after_a_reopen(path: Path) -> None:
    clock = Clock()
    database = Database.open(path)
    chat = chats(database, clock)
    kept = responses(database, clock)
    for n in range(3):
        assert chat.keep(completion(f"chatcmpl-{n}", text=f"answer {n}"), request(), f"req_{n}")
    items = [{"id": "msg_1", "type": "message", "content": "weather?"}]
    assert kept.keep({"id": "resp_1", "status": "completed"}, CONVERSATION, items)
    before = (chat.get("chatcmpl-1"), chat.messages("chatcmpl-1", PageQuery()), ids(chat))
    database.close()
    assert oct(path.stat().st_mode & 0o777) == "0o600"  # it holds prompts and answers

    database = Database.open(path)
    chat = chats(database, clock)
    kept = responses(database, clock)
    assert (chat.get("chatcmpl-1"), chat.messages("chatcmpl-1", PageQuery()), ids(chat)) == before
    assert len(chat) == 3
    assert kept.conversation("resp_1") == CONVERSATION  # Messages, tool calls, unicode
    assert kept.get("resp_1").items == (("msg_1", orjson.dumps(items[0])),)
    assert orjson.loads(kept.input_items("resp_1", PageQuery()))["data"] == items
    # Stored after a reopen within the same second: still listed after the earlier ones.
    chat.keep(completion("chatcmpl-new"), request(), "req_new")
    assert ids(chat) == ["chatcmpl-0", "chatcmpl-1", "chatcmpl-2", "chatcmpl-new"]
    database.close()


def test_updates_and_deletes_are_written_through_and_an_update_keeps_its_place(
    path: Path,
) -> None:
    clock = Clock()
    database = Database.open(path)
    chat = chats(database, clock, count=2)
    chat.keep(completion("a"), request(), "r")
    chat.keep(completion("b"), request(), "r")
    chat.update("a", {"k": "v"})  # changed in place: "a" is still the oldest
    database.close()

    database = Database.open(path)
    chat = chats(database, clock, count=2)
    assert orjson.loads(chat.get("a"))["metadata"] == {"k": "v"}
    chat.keep(completion("c"), request(), "r")  # past the count: "a", the oldest, goes
    assert ids(chat) == ["b", "c"]
    chat.delete("b")
    database.close()

    database = Database.open(path)
    assert ids(chats(database, clock)) == ["c"]
    database.close()


def test_the_bounds_are_applied_again_at_open(path: Path) -> None:
    clock = Clock()
    database = Database.open(path)
    chat = chats(database, clock)
    for n in range(5):
        chat.keep(completion(f"c{n}", created=100 + n), request(), "r")
    size = chat.nbytes // 5
    database.close()

    database = Database.open(path)  # the count shrank: the oldest go, from the file too
    assert ids(chats(database, clock, count=3)) == ["c2", "c3", "c4"]
    database.close()
    database = Database.open(path)  # the bytes shrank
    assert ids(chats(database, clock, nbytes=2 * size)) == ["c3", "c4"]
    database.close()
    database = Database.open(path)
    chat = chats(database, clock)
    assert ids(chat) == ["c3", "c4"]
    assert chat.nbytes == 2 * size
    database.close()


def test_expiry_is_on_the_wall_clock_across_a_reopen(path: Path) -> None:
    clock = Clock()
    database = Database.open(path)
    chat = chats(database, clock, ttl=60)
    chat.keep(completion("early"), request(), "r")
    clock.now += 30
    chat.keep(completion("late"), request(), "r")
    database.close()

    clock.now += 31  # "early" expired while no gateway ran
    database = Database.open(path)
    chat = chats(database, clock, ttl=60)
    assert ids(chat) == ["late"]
    database.close()
    [(count,)] = sqlite3.connect(path).execute("SELECT count(*) FROM entries").fetchall()
    assert count == 1  # dropped from the file too

    database = Database.open(path)  # a TTL that shrank applies to what is kept
    chat = chats(database, clock, ttl=10)
    clock.now += 9.9
    assert ids(chat) == ["late"]
    clock.now += 0.1
    assert ids(chat) == []
    database.close()


def test_a_persisted_expiry_is_wall_clock_time(path: Path) -> None:
    database = Database.open(path)
    store = ResponseStore.from_config(GatewayConfig(store_ttl=3600), database)
    before = time.time()
    store.keep({"id": "resp_1", "status": "completed"}, CONVERSATION)
    database.close()
    [(expires_at,)] = sqlite3.connect(path).execute("SELECT expires_at FROM entries").fetchall()
    assert before + 3600 <= expires_at <= time.time() + 3600


def test_an_entry_an_older_one_outlives_goes_no_later_than_it(path: Path) -> None:
    """A row expires no later than any stored after it, so that the oldest is always the
    first to go (rows stored under a longer TTL than a later gateway's)."""
    clock = Clock()
    database = Database.open(path)
    chats(database, clock, ttl=1000).keep(completion("long"), request(), "r")
    database.close()
    database = Database.open(path)
    chats(database, clock, ttl=10).keep(completion("short"), request(), "r")
    database.close()
    database = Database.open(path)
    chat = chats(database, clock, ttl=1000)
    clock.now += 10
    assert ids(chat) == []
    database.close()


async def test_concurrent_writers_from_many_tasks(path: Path) -> None:
    database = Database.open(path)
    chat = chats(database, Clock(), count=1000)
    store = responses(database, Clock(), count=1000)

    async def one(n: int) -> None:
        await asyncio.sleep(0)
        chat.keep(completion(f"c{n:03}", text=str(n)), request(f"q{n}"), f"r{n}")
        await asyncio.sleep(0)
        store.keep({"id": f"resp_{n}", "status": "completed"}, (Message("user", str(n)),))
        await asyncio.sleep(0)
        if n % 3 == 0:
            chat.update(f"c{n:03}", {"n": str(n)})
        if n % 5 == 0:
            store.delete(f"resp_{n}")

    await asyncio.gather(*(one(n) for n in range(200)))
    expected = (ids(chat), len(store))
    database.close()

    database = Database.open(path)
    chat = chats(database, Clock(), count=1000)
    store = responses(database, Clock(), count=1000)
    assert (ids(chat), len(store)) == expected == ([f"c{n:03}" for n in range(200)], 160)
    assert orjson.loads(chat.get("c099"))["metadata"] == {"n": "99"}
    assert store.conversation("resp_7") == (Message("user", "7"),)
    database.close()


def test_a_file_that_is_not_sqlite_is_one_clear_error(path: Path) -> None:
    path.parent.mkdir(parents=True)
    path.write_bytes(os.urandom(8192))
    with pytest.raises(StoreUnavailable) as caught:
        Database.open(path)
    message = str(caught.value)
    assert message == (
        f"the store {path} is not a SQLite database (another kind of file, or damaged). "
        "Start with --store memory (nothing kept across restarts) or --store ANOTHER_PATH."
    )
    Database.open(path.with_name("other.sqlite3")).close()  # the lock was let go of
    path.unlink()
    Database.open(path).close()


def test_a_damaged_file_is_one_clear_error(path: Path) -> None:
    database = Database.open(path)
    chat = chats(database, Clock(), count=1000)
    for n in range(300):
        chat.keep(completion(f"c{n}", text="x" * 500), request(), "r")
    database.close()
    data = bytearray(path.read_bytes())
    assert len(data) > 16 * 4096
    data[8 * 4096 : 12 * 4096] = os.urandom(4 * 4096)  # pages of the table, the header intact
    path.write_bytes(bytes(data))
    with pytest.raises(StoreUnavailable) as caught:
        Database.open(path)
    assert f"the store {path} is damaged" in str(caught.value)
    assert "--store memory" in str(caught.value)


def test_a_file_another_gateway_holds_is_one_clear_error(path: Path) -> None:
    first = Database.open(path)
    with pytest.raises(StoreUnavailable) as caught:
        Database.open(path)
    assert str(caught.value) == (
        f"the store {path} is in use by another gateway (pid {os.getpid()}; its lock is "
        f"{lock_path(path)}). Start with --store memory (nothing kept across restarts) or "
        "--store ANOTHER_PATH."
    )
    first.close()
    first.close()  # again: nothing
    Database.open(path).close()  # released


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_a_file_that_cannot_be_read_is_one_clear_error(path: Path) -> None:
    Database.open(path).close()
    path.chmod(0)
    with pytest.raises(StoreUnavailable) as caught:
        Database.open(path)
    assert f"the store {path} cannot be opened: Permission denied" in str(caught.value)


def test_a_directory_is_one_clear_error(path: Path) -> None:
    path.mkdir(parents=True)
    with pytest.raises(StoreUnavailable) as caught:
        Database.open(path)
    assert f"the store {path} is a directory" in str(caught.value)
    blocked = path / "file"
    blocked.write_text("")
    with pytest.raises(StoreUnavailable) as caught:
        Database.open(blocked / "store.sqlite3")  # its directory would be a file
    assert "cannot be made (its directory" in str(caught.value)


def test_a_newer_schema_is_refused(path: Path) -> None:
    Database.open(path).close()
    with sqlite3.connect(path) as raw:
        raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StoreUnavailable) as caught:
        Database.open(path)
    assert f"was written by a newer Orchard (schema {SCHEMA_VERSION + 1}" in str(caught.value)


def test_a_row_that_does_not_decode_is_dropped_with_a_warning(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    database = Database.open(path)
    chats(database, Clock()).keep(completion("good"), request(), "r")
    database.close()
    with sqlite3.connect(path) as raw:
        raw.execute(
            "INSERT INTO entries VALUES ('chat', 'bad', ?, 10, ?)", (b"{}", 2_000_000_000.0)
        )
    database = Database.open(path)
    with caplog.at_level(logging.WARNING, "gateway.stores"):
        assert ids(chats(database, Clock())) == ["good"]
    assert "1 chat entries could not be read back" in caplog.text
    database.close()
    [(count,)] = sqlite3.connect(path).execute("SELECT count(*) FROM entries").fetchall()
    assert count == 1


def test_a_write_that_fails_is_logged_once_and_the_store_goes_on(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    database = Database.open(path)
    chat = chats(database, Clock())
    database.close()  # every write now fails
    with caplog.at_level(logging.ERROR, "gateway.stores"):
        assert chat.keep(completion("a"), request(), "r")
        assert chat.keep(completion("b"), request(), "r")
    assert ids(chat) == ["a", "b"]  # in memory
    [record] = caplog.records
    assert f"could not write to the store {path}" in record.getMessage()


def test_the_app_opens_the_file_at_creation(path: Path) -> None:
    app = create_app(GatewayConfig(store_path=path))
    try:
        assert app.state.database.path == path
        with pytest.raises(StoreUnavailable):
            create_app(GatewayConfig(store_path=path))
        store: CompletionStore = app.state.store
        store.keep(completion("a"), request(), "r")
    finally:
        close_app(app)
    app = create_app(GatewayConfig(store_path=path))
    try:
        assert ids(app.state.store) == ["a"]
        with pytest.raises(ApiError):
            app.state.responses.get("resp_nowhere")
    finally:
        close_app(app)
    memory = create_app()
    assert memory.state.database is None
    close_app(memory)
