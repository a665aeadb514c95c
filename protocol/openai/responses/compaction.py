"""Compaction (`POST /v1/responses/compact`) on a local model: what it means, and its items.

At OpenAI, compacting a conversation returns its user messages and an opaque `compaction`
item that stands for the rest; a later create takes them as its input, in far fewer tokens.
Here the model itself does the compaction: it is asked, after the whole conversation, to
write a summary of it (`COMPACTION_PROMPT`), and the summary is the compaction item's
content. The output is the conversation's user messages as they were, then that item. A later
create (`protocol.openai.responses.input`) turns the item back into a user message that gives
the summary (`summary_message`), so the model continues from its own summary and the user's
words.

`encrypted_content` is opaque to clients but not encrypted: it is this gateway's marker and
the summary as JSON, in base64url. Anything else in a `compaction` item (another server's
compaction, an edited one) is a 400 naming it. How good a compaction is depends on the model:
a small one may summarise poorly, and the summary costs a generation of up to
`MAX_SUMMARY_TOKENS` tokens.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from protocol.core.errors import invalid_request
from protocol.frames import Message

MAX_SUMMARY_TOKENS = 1024
"""The longest summary a compaction asks the model for."""
COMPACTION_PROMPT = (
    "Compact the conversation so far into a summary for yourself, to continue from later in "
    "place of the conversation: the user's goals and constraints, what was decided and done "
    "(tool calls and their results included), and what is still open. Write only the summary."
)
"""The user turn, after the whole conversation, that asks the model for its summary."""
SUMMARY_PREFIX = "A summary of the conversation so far (compacted):\n\n"
"""How the summary reads to the model when a later create gives it back."""
_MARKER = b"orchard-compaction-v1:"


def compaction_messages(conversation: Sequence[Message]) -> tuple[Message, ...]:
    """What the model is given to compact `conversation` (the instructions go first, as for a
    create)."""
    return (*conversation, Message("user", COMPACTION_PROMPT))


def encode_summary(summary: str) -> str:
    """The opaque `encrypted_content` of a compaction item carrying `summary`."""
    payload = _MARKER + orjson.dumps({"summary": summary})
    return base64.urlsafe_b64encode(payload).decode()


def decode_summary(content: str, param: str) -> str:
    """The summary in a compaction item's `encrypted_content`; a 400 naming `param` for one
    this gateway did not make."""
    try:
        payload = base64.urlsafe_b64decode(content.encode())
        if not payload.startswith(_MARKER):
            raise ValueError("not ours")
        data = orjson.loads(payload[len(_MARKER) :])
        summary = data["summary"]
        if type(summary) is not str:
            raise TypeError("no summary")
    except (ValueError, TypeError, KeyError, binascii.Error, orjson.JSONDecodeError):
        raise invalid_request(
            f"Invalid '{param}': not a compaction made by this server (compaction items are "
            "opaque: give back the one POST /v1/responses/compact returned, unchanged).",
            param,
            "invalid_value",
        ) from None
    return summary


def summary_message(summary: str) -> Message:
    """A compaction item, as the model reads it in a later create."""
    return Message("user", SUMMARY_PREFIX + summary)


def compacted_output(
    conversation: Sequence[Message], summary: str, new_id: Callable[[str], str]
) -> list[dict[str, Any]]:
    """The compact's output: the conversation's user messages as they were, then the
    compaction item."""
    kept: list[dict[str, Any]] = [
        {
            "id": new_id("msg"),
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": message.content}],
            "status": "completed",
        }
        for message in conversation
        if message.role == "user" and not message.content.startswith(SUMMARY_PREFIX)
    ]
    item = {"id": new_id("cmp"), "type": "compaction", "encrypted_content": encode_summary(summary)}
    return [*kept, item]
