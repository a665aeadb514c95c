"""Stored responses (`store`, OpenAI's default): kept in memory, and written through to the
`--store` database when there is one (gateway.stores.sqlite), so that `GET /v1/responses/{id}`
can answer them and `previous_response_id` can continue them, across a restart too.

Bounded as stored chat completions are (gateway.stores.chat), with the same settings and a store
of its own (a `gateway.stores.bounded.BoundedStore`): at most `store_max_completions` responses
and `store_max_bytes` of JSON (past either, the oldest stored is dropped first), each for
`store_ttl` seconds from when it was stored. A response is stored
once it has finished, completed or incomplete (max_output_tokens); a failed or cancelled one is
not.

Each entry keeps the response object (JSON), the conversation that continues it (the
earlier turns, this turn's input and the response's output as an assistant message; not the
instructions: OpenAI does not carry them over to the next response) and its input items
(`GET /v1/responses/{id}/input_items`), all counted in its bytes.

The store takes its clock as an argument, so that tests drive expiry without waiting.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import attrs
import orjson

from gateway.stores.bounded import BoundedAnswers
from protocol.core.errors import ApiError
from protocol.frames import Message
from protocol.openai.pages import PageQuery, list_body, page

log = logging.getLogger("gateway.responses_store")


@attrs.define
class StoredResponse:
    id: str
    body: bytes
    """The response object, as JSON."""
    conversation: tuple[Message, ...]
    """Every message up to and including this response's answer (without instructions)."""
    items: tuple[tuple[str, bytes], ...] = ()
    """Its input items (protocol.openai.responses.items), oldest first: (id, JSON)."""
    events: tuple[bytes, ...] = ()
    """A background response's events as SSE frames, in order (for `?stream=true`); none for
    the others."""


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
        "expired: responses are kept for a bounded time).",
        "invalid_request_error",
        "previous_response_id",
        "previous_response_not_found",
    )


def previous_not_continuable(response_id: str, status: str) -> ApiError:
    return ApiError(
        400,
        f"Previous response with id '{response_id}' is {status}: only a completed or "
        "incomplete response can be continued.",
        "invalid_request_error",
        "previous_response_id",
        "previous_response_not_continuable",
    )


class ResponseStore(BoundedAnswers[StoredResponse]):
    """The stored responses (see the module docstring), within the bounds of a
    `BoundedStore`; every method first drops what has expired."""

    STORE = "responses"
    VALUE = StoredResponse

    def keep(
        self,
        response: dict[str, object],
        conversation: tuple[Message, ...],
        items: Sequence[dict[str, Any]] = (),
        *,
        events: tuple[bytes, ...] = (),
    ) -> bool:
        """Store a finished response with the conversation that continues it, its input
        `items` and (a background response) its `events`; False when it alone is over the
        byte budget."""
        if not self.enabled:
            return False
        response_id = str(response["id"])
        body = orjson.dumps(response)
        listed = tuple((str(item["id"]), orjson.dumps(item)) for item in items)
        size = (
            len(body)
            + sum(
                len(m.content)
                + len(m.reasoning or "")
                + sum(len(c.arguments) + len(c.name) for c in m.tool_calls)
                for m in conversation
            )
            + sum(len(data) for _, data in listed)
            + sum(len(event) for event in events)
        )
        if not self._entries.put(
            response_id, StoredResponse(response_id, body, conversation, listed, events), size
        ):
            log.warning(
                "response %s not stored: %d bytes, over --store-max-bytes", response_id, size
            )
            return False
        return True

    def get(self, response_id: str) -> StoredResponse:
        """A stored response; raises the 404 for an unknown (or expired) id."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise response_not_found(response_id)
        return entry

    def input_items(self, response_id: str, query: PageQuery) -> bytes:
        """A page of a stored response's input items, as OpenAI's list object; the 404 for an
        unknown (or expired) response, a 400 for an `after` that is none of its items."""
        chosen, has_more = page(self.get(response_id).items, query, lambda item: item[0], "item")
        return list_body([data for _, data in chosen], [id for id, _ in chosen], has_more)

    def conversation(self, previous_response_id: str) -> tuple[Message, ...]:
        """The conversation a new response continues; a 400 naming previous_response_id
        when it is not stored (or expired)."""
        entry = self._entries.get(previous_response_id)
        if entry is None:
            raise previous_not_found(previous_response_id)
        status = orjson.loads(entry.body)["status"]
        if status not in ("completed", "incomplete"):  # a background response's other ends
            raise previous_not_continuable(previous_response_id, status)
        return entry.conversation

    def entries(self) -> list[StoredResponse]:
        """Every stored response not expired, oldest stored first."""
        return self._entries.values()

    def replace(self, response_id: str, response: dict[str, object]) -> None:
        """Give a stored response a new object (a background response a restart failed),
        keeping the rest of its entry."""
        entry = self.get(response_id)
        self.keep(
            response,
            entry.conversation,
            [orjson.loads(data) for _, data in entry.items],
            events=entry.events,
        )

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        self._entries.pop(response_id)
