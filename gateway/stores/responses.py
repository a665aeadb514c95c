"""Stored responses (`store`, OpenAI's default): kept in memory so that
`GET /v1/responses/{id}` can answer them and `previous_response_id` can continue them.

Bounded as stored chat completions are (gateway.stores.chat), with the same settings and a store
of its own: at most `store_max_completions` responses and `store_max_bytes` of JSON (past
either, the oldest stored is dropped first), each for `store_ttl` seconds from when it was
stored. Nothing survives a restart. A response is stored once it has finished, completed or
incomplete (max_output_tokens); a failed or cancelled one is not.

Each entry keeps the response object (JSON) and the conversation that continues it: the
earlier turns, this turn's input and the response's output as an assistant message (not the
instructions: OpenAI does not carry them over to the next response).

The store takes its clock as an argument, so that tests drive expiry without waiting.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import attrs
import orjson

from gateway.config import GatewayConfig
from protocol.core.errors import ApiError
from protocol.frames import Message

log = logging.getLogger("gateway.responses_store")


@attrs.define
class StoredResponse:
    id: str
    body: bytes
    """The response object, as JSON."""
    conversation: tuple[Message, ...]
    """Every message up to and including this response's answer (without instructions)."""
    nbytes: int
    expires: float


def response_not_found(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"Response with id '{response_id}' not found.",
        "invalid_request_error",
        "response_id",
        None,
    )


def previous_not_found(response_id: str) -> ApiError:
    return ApiError(
        400,
        f"Previous response with id '{response_id}' not found (never stored here, or "
        "expired: responses are kept in memory for a bounded time).",
        "invalid_request_error",
        "previous_response_id",
        "previous_response_not_found",
    )


class ResponseStore:
    """The stored responses (see the module docstring); every method first drops what has
    expired."""

    def __init__(
        self,
        max_responses: int,
        max_bytes: int,
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._clock = clock
        self._entries: dict[str, StoredResponse] = {}
        """Oldest stored first: the order of eviction and of expiry."""
        self.nbytes = 0

    @classmethod
    def from_config(cls, config: GatewayConfig) -> ResponseStore:
        return cls(config.store_max_completions, config.store_max_bytes, config.store_ttl)

    @property
    def enabled(self) -> bool:
        """False when the limits leave no room: nothing is stored, and `store: true` and
        `previous_response_id` are refused."""
        return self.max_responses > 0 and self.max_bytes > 0 and self.ttl > 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def keep(self, response: dict[str, object], conversation: tuple[Message, ...]) -> bool:
        """Store a finished response; False when it alone is over the byte budget."""
        if not self.enabled:
            return False
        self._expire()
        response_id = str(response["id"])
        body = orjson.dumps(response)
        size = len(body) + sum(
            len(m.content)
            + len(m.reasoning or "")
            + sum(len(c.arguments) + len(c.name) for c in m.tool_calls)
            for m in conversation
        )
        if size > self.max_bytes:
            log.warning(
                "response %s not stored: %d bytes, over --store-max-bytes", response_id, size
            )
            return False
        self._drop(response_id)
        self._entries[response_id] = StoredResponse(
            response_id, body, conversation, size, self._clock() + self.ttl
        )
        self.nbytes += size
        while len(self._entries) > self.max_responses or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, response_id: str) -> StoredResponse:
        """A stored response; raises the 404 for an unknown (or expired) id."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None:
            raise response_not_found(response_id)
        return entry

    def conversation(self, previous_response_id: str) -> tuple[Message, ...]:
        """The conversation a new response continues; a 400 naming previous_response_id
        when it is not stored (or expired)."""
        self._expire()
        entry = self._entries.get(previous_response_id)
        if entry is None:
            raise previous_not_found(previous_response_id)
        return entry.conversation

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        self._drop(response_id)

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.nbytes -= entry.nbytes

    def _expire(self) -> None:
        now = self._clock()
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.expires > now:
                return
            self._drop(oldest.id)
