"""Stored chat completions (`store: true`), kept in the gateway's memory and, with `--store
PATH` (the default of `orchard gateway`), written through to its database (gateway.stores.
sqlite), so that they outlive a restart.

`CompletionStore` holds them, bounded three ways (docs/operations.md): at most
`store_max_completions` of them and `store_max_bytes` of JSON together (past either, the
oldest stored is dropped first), each for `store_ttl` seconds.
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
from collections.abc import Callable
from typing import Any

import attrs
import orjson

from gateway.stores.bounded import Backing, BoundedAnswers
from protocol.openai.chat.stored import (
    ListQuery,
    StoreRequest,
    completion_deleted,
    stored_completion,
    stored_messages,
)
from protocol.openai.errors import completion_not_found
from protocol.openai.pages import PageQuery, list_body, page

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

    @property
    def nbytes(self) -> int:
        return len(self.body) + sum(len(message) for _, message in self.messages)


def _sort_key(entry: StoredCompletion) -> tuple[int, int]:
    return entry.created, entry.seq


class CompletionStore(BoundedAnswers[StoredCompletion]):
    """The stored completions (see the module docstring), within the bounds of a
    `BoundedStore`. Every method first drops what has expired."""

    STORE = "chat"
    VALUE = StoredCompletion

    def __init__(
        self,
        max_completions: int,
        max_bytes: int,
        ttl: float,
        clock: Callable[[], float] | None = None,
        *,
        backing: Backing[str, StoredCompletion] | None = None,
    ) -> None:
        super().__init__(max_completions, max_bytes, ttl, clock, backing=backing)
        # Past what an earlier gateway stored, so that the order holds across a restart.
        self._seq = max((entry.seq for entry in self._entries.values()), default=0)

    @property
    def max_completions(self) -> int:
        return self.max_entries

    # --- writing ----------------------------------------------------------------------------

    def keep(self, body: dict[str, Any], request: StoreRequest, request_id: str) -> bool:
        """Store a finished completion (`body` is its `chat.completion` object). False when
        it is larger than the whole byte budget and so cannot be kept."""
        if not self.enabled:
            return False
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
        )
        entry.body = orjson.dumps(stored_completion(body, request, request_id, entry.metadata))
        size = entry.nbytes
        # Ids are unique: a completion stored under one already there only replaces it.
        if not self._entries.put(completion_id, entry, size):
            log.warning(
                "chat completion %s not stored: %d bytes of JSON, over --store-max-bytes (%d)",
                completion_id,
                size,
                self.max_bytes,
            )
            return False
        return True

    def update(self, completion_id: str, metadata: dict[str, str]) -> bytes:
        """Replace a completion's metadata; its stored object, updated, as JSON."""
        entry = self._get(completion_id)
        entry.metadata = dict(metadata)
        obj = orjson.loads(entry.body)
        obj["metadata"] = entry.metadata
        entry.body = orjson.dumps(obj)
        self._entries.resize(completion_id, entry.nbytes)
        return entry.body

    def delete(self, completion_id: str) -> bytes:
        """Delete a completion; the deletion object as JSON."""
        self._get(completion_id)
        self._entries.pop(completion_id)
        return orjson.dumps(completion_deleted(completion_id))

    # --- reading ----------------------------------------------------------------------------

    def get(self, completion_id: str) -> bytes:
        """A completion's stored object as JSON; raises the 404 for an unknown id."""
        return self._get(completion_id).body

    def list(self, query: ListQuery) -> bytes:
        """A page of the completions that match the query's filters, as the list object."""
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

    def _get(self, completion_id: str) -> StoredCompletion:
        entry = self._entries.get(completion_id)
        if entry is None:
            raise completion_not_found(completion_id)
        return entry


def _id_of(entry: StoredCompletion) -> str:
    return entry.id


def _first(message: tuple[str, bytes]) -> str:
    return message[0]


# --- what is stored ---------------------------------------------------------------------------
