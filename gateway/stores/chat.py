"""Stored chat completions (`store: true`), kept in the gateway's memory.

`CompletionStore` holds them, bounded three ways (docs/operations.md): at most
`store_max_completions` of them and `store_max_bytes` of JSON together (past either, the
oldest stored is dropped first), each for `store_ttl` seconds. Nothing survives a restart.
What the objects look like, the query parameters and the paging are protocol.openai.chat.stored's;
the endpoints are gateway.openai.chat.stored.

A request is stored once it has finished as OpenAI would store it: its runner ended it with
`stop`, `length` or `tool_calls` (`keepable`). One that fails, or is cancelled (its client
left, a WebSocket `cancel`, a runner's drain deadline), is not stored. A streamed request's
completion is collected by a `Keeper` from the chunks its `Relay` renders (the same for SSE
and the browser socket); a non-streaming one is its response body.

The store takes its clock as an argument, so that tests drive expiry without waiting.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import attrs
import orjson

from gateway.config import GatewayConfig
from protocol.core.stream import CompletionBuilder
from protocol.frames import Chunk
from protocol.openai.chat.request import ChatRequest
from protocol.openai.chat.response import chat_completion_body
from protocol.openai.chat.stored import (
    ListQuery,
    PageQuery,
    StoreRequest,
    completion_deleted,
    list_body,
    page,
    stored_completion,
    stored_messages,
)
from protocol.openai.errors import completion_not_found

log = logging.getLogger("gateway.stored")


@attrs.define
class StoredCompletion:
    """One stored completion: its object and its messages, already in JSON."""

    id: str
    model: str
    created: int
    seq: int
    """Order of storing, for completions created in the same second."""
    metadata: dict[str, str]
    body: bytes
    """The stored object (protocol.openai.chat.stored.stored_completion)."""
    messages: list[tuple[str, bytes]]
    """The request's messages: (id, JSON)."""
    expires: float
    """When it goes, on the store's clock."""

    @property
    def nbytes(self) -> int:
        return len(self.body) + sum(len(message) for _, message in self.messages)


def _sort_key(entry: StoredCompletion) -> tuple[int, int]:
    return entry.created, entry.seq


class CompletionStore:
    """The stored completions (see the module docstring). Every method first drops what
    has expired."""

    def __init__(
        self,
        max_completions: int,
        max_bytes: int,
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_completions = max_completions
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._clock = clock
        self._entries: dict[str, StoredCompletion] = {}
        """Oldest stored first: the order of eviction and of expiry."""
        self._seq = 0
        self.nbytes = 0
        """The size of everything stored, as JSON."""

    @classmethod
    def from_config(cls, config: GatewayConfig) -> CompletionStore:
        return cls(config.store_max_completions, config.store_max_bytes, config.store_ttl)

    @property
    def enabled(self) -> bool:
        """False when the limits leave no room: `store: true` is refused then."""
        return self.max_completions > 0 and self.max_bytes > 0 and self.ttl > 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    # --- writing ----------------------------------------------------------------------------

    def keep(self, body: dict[str, Any], request: StoreRequest, request_id: str) -> bool:
        """Store a finished completion (`body` is its `chat.completion` object). False when
        it is larger than the whole byte budget and so cannot be kept."""
        if not self.enabled:
            return False
        self._expire()
        completion_id: str = body["id"]
        self._seq += 1
        entry = StoredCompletion(
            id=completion_id,
            model=body["model"],
            created=body["created"],
            seq=self._seq,
            metadata=dict(request.metadata),
            body=b"",
            messages=[
                (item["id"], orjson.dumps(item)) for item in stored_messages(completion_id, request)
            ],
            expires=self._clock() + self.ttl,
        )
        entry.body = orjson.dumps(stored_completion(body, request, request_id, entry.metadata))
        size = entry.nbytes
        if size > self.max_bytes:
            log.warning(
                "chat completion %s not stored: %d bytes of JSON, over --store-max-bytes (%d)",
                completion_id,
                size,
                self.max_bytes,
            )
            return False
        self._drop(completion_id)  # ids are unique; this only guards the byte count
        self._entries[completion_id] = entry
        self.nbytes += size
        self._shrink(completion_id)
        return True

    def update(self, completion_id: str, metadata: dict[str, str]) -> bytes:
        """Replace a completion's metadata; its stored object, updated, as JSON."""
        entry = self._get(completion_id)
        self.nbytes -= entry.nbytes
        entry.metadata = dict(metadata)
        obj = orjson.loads(entry.body)
        obj["metadata"] = entry.metadata
        entry.body = orjson.dumps(obj)
        self.nbytes += entry.nbytes
        self._shrink(completion_id)
        return entry.body

    def delete(self, completion_id: str) -> bytes:
        """Delete a completion; the deletion object as JSON."""
        self._get(completion_id)
        self._drop(completion_id)
        return orjson.dumps(completion_deleted(completion_id))

    # --- reading ----------------------------------------------------------------------------

    def get(self, completion_id: str) -> bytes:
        """A completion's stored object as JSON; raises the 404 for an unknown id."""
        return self._get(completion_id).body

    def list(self, query: ListQuery) -> bytes:
        """A page of the completions that match the query's filters, as the list object."""
        self._expire()
        matching = sorted(
            (e for e in self._entries.values() if query.matches(e.model, e.metadata)),
            key=_sort_key,
        )
        chosen, has_more = page(matching, query.page, _id_of, "stored chat completion")
        return list_body([e.body for e in chosen], [e.id for e in chosen], has_more)

    def messages(self, completion_id: str, query: PageQuery) -> bytes:
        """A page of a completion's messages, as the list object."""
        messages = self._get(completion_id).messages
        chosen, has_more = page(messages, query, _first, "message of this chat completion")
        return list_body([data for _, data in chosen], [id for id, _ in chosen], has_more)

    # --- bounds -----------------------------------------------------------------------------

    def _get(self, completion_id: str) -> StoredCompletion:
        self._expire()
        entry = self._entries.get(completion_id)
        if entry is None:
            raise completion_not_found(completion_id)
        return entry

    def _drop(self, completion_id: str) -> None:
        entry = self._entries.pop(completion_id, None)
        if entry is not None:
            self.nbytes -= entry.nbytes

    def _expire(self) -> None:
        now = self._clock()
        entries = self._entries
        # The TTL is the same for all, so the oldest stored is the first to expire.
        while entries:
            oldest = next(iter(entries.values()))
            if oldest.expires > now:
                return
            self._drop(oldest.id)

    def _shrink(self, spare: str) -> None:
        """Drop the oldest until the store is within its bounds, `spare` last of all."""
        entries = self._entries
        while len(entries) > self.max_completions or self.nbytes > self.max_bytes:
            victim = next((id for id in entries if id != spare), None)
            if victim is None:
                return
            self._drop(victim)


def _id_of(entry: StoredCompletion) -> str:
    return entry.id


def _first(message: tuple[str, bytes]) -> str:
    return message[0]


# --- what is stored ---------------------------------------------------------------------------


def keepable(builder: CompletionBuilder) -> bool:
    """True when the request the builder collected finished as OpenAI stores one: ended by
    its runner with stop, length or tool_calls (not failed, not cancelled)."""
    last = builder.last
    return (
        builder.error is None
        and last is not None
        and last.finish_reason is not None
        and last.finish_reason != "cancelled"
    )


class Keeper:
    """Stores a streamed `store: true` completion when it finishes: the relay feeds it each
    chunk it renders, and it collects them as a non-streaming response would."""

    __slots__ = (
        "_builder",
        "created",
        "fingerprint",
        "id",
        "model",
        "request",
        "request_id",
        "store",
    )

    def __init__(
        self,
        store: CompletionStore,
        request: StoreRequest,
        *,
        id: str,
        created: int,
        model: str,
        fingerprint: str | None,
        logprobs: bool,
        n: int,
        request_id: str,
    ) -> None:
        self.store = store
        self.request = request
        self.id = id
        self.created = created
        self.model = model
        self.fingerprint = fingerprint
        self.request_id = request_id
        self._builder = CompletionBuilder(logprobs=logprobs, n=n)

    @classmethod
    def of(
        cls,
        store: CompletionStore,
        chat: ChatRequest,
        *,
        id: str,
        created: int,
        fingerprint: str | None,
        request_id: str,
    ) -> Keeper | None:
        """The keeper of a request's stream; None unless it asked for `store: true`."""
        if chat.store is None:
            return None
        return cls(
            store,
            chat.store,
            id=id,
            created=created,
            model=chat.model,
            fingerprint=fingerprint,
            logprobs=chat.logprobs,
            n=chat.n,
            request_id=request_id,
        )

    def feed(self, chunk: Chunk) -> None:
        """A chunk the request's stream rendered; the last one stores the completion."""
        builder = self._builder
        if builder.feed(chunk) and keepable(builder):
            body = chat_completion_body(
                builder,
                id=self.id,
                created=self.created,
                model=self.model,
                fingerprint=self.fingerprint,
            )
            self.store.keep(body, self.request, self.request_id)
