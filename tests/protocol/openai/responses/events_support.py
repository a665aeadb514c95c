"""What the Responses event tests share: deterministic ids, a request's base object, the
events of SSE messages (checked), and chunks of one request."""

from __future__ import annotations

from typing import Any

import orjson

from protocol.frames import Chunk, ToolCallDelta, Usage
from protocol.openai.responses.events import response_base
from protocol.openai.responses.request import parse_responses_object

RID = "resp_1"


class Ids:
    """Deterministic item ids: msg_1, rs_2, ..."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}_{self.n}"


def base(**extra: Any) -> dict[str, Any]:
    request = parse_responses_object({"model": "m", "input": "hi", **extra}, store=True)
    return response_base(request, id=RID, created_at=100, store=True)


def parse(messages: list[bytes]) -> list[dict[str, Any]]:
    """Each SSE event's data, checking its `event:` line names its type."""
    events = []
    for block in b"".join(messages).split(b"\n\n")[:-1]:
        head, data = block.split(b"\n")
        assert head.startswith(b"event: ")
        assert data.startswith(b"data: ")
        event = orjson.loads(data[6:])
        assert event["type"] == head[7:].decode()
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def chunk(
    seq: int,
    text: str = "",
    reasoning: str = "",
    *,
    done: str | None = None,
    calls: tuple[ToolCallDelta, ...] = (),
    usage: Usage | None = None,
) -> Chunk:
    return Chunk(
        RID,
        seq,
        text,
        reasoning,
        1,
        usage or Usage(5, seq + 1),
        done,  # type: ignore[arg-type]  # a FinishReason in every call below
        tool_calls=calls,
    )
