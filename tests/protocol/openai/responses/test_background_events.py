"""A background response's events (`ResponseEvents` of a `background: true` request): queued
first, then the stream as any; a failure is always `response.failed`; a cancel ends it with
its own status and no event; `snapshot` is the object as it stands at each step."""

from __future__ import annotations

from typing import Any

from protocol.core.errors import server_error
from protocol.core.stream import CompletionStream
from protocol.frames import Chunk, Usage
from protocol.openai.responses.events import ResponseEvents
from tests.protocol.openai.responses.events_support import RID, Ids, base, chunk, parse


def background() -> tuple[ResponseEvents, CompletionStream, list[bytes]]:
    events = ResponseEvents(base(background=True), clock=lambda: 200, new_id=Ids())
    return events, CompletionStream(events, events), [events.queued()]


def types(out: list[bytes]) -> list[str]:
    return [e["type"] for e in parse(out)]


def test_queued_then_in_progress_then_completed() -> None:
    events, completion, out = background()
    assert events.snapshot()["status"] == "queued"
    first = parse(out)
    assert [(e["type"], e["response"]["status"]) for e in first] == [
        ("response.created", "queued"),
        ("response.queued", "queued"),
    ]
    assert first[0]["response"] == first[1]["response"] == events.snapshot()
    assert (first[0]["response"]["background"], first[0]["response"]["output"]) == (True, [])
    completion.feed(chunk(0, "Hel"), out)
    assert events.snapshot()["status"] == "in_progress"
    completion.feed(chunk(1, "lo", done="stop"), out)
    assert types(out) == [
        "response.created",
        "response.queued",
        "response.in_progress",  # no second response.created
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = parse(out)[-1]["response"]
    assert events.ended == events.response == events.snapshot() == final
    assert (final["status"], final["background"]) == ("completed", True)


def test_a_failure_before_the_first_token_is_response_failed() -> None:
    events, completion, out = background()
    completion.fail(server_error("no runner"), out)
    last = parse(out)[-1]
    assert last["type"] == "response.failed"  # not the error event: created was sent
    assert last["response"]["status"] == "failed"
    assert last["response"]["error"] == {"code": "server_error", "message": "no runner"}
    assert events.snapshot() == last["response"]
    assert events.response is None  # nothing to store as an answer


def test_a_cancel_confirmed_by_the_runner_ends_it_cancelled_with_no_event() -> None:
    events, completion, out = background()
    completion.feed(chunk(0, "Part"), out)
    completion.feed(Chunk(RID, 1, "", "", 0, Usage(5, 1), "cancelled"), out)
    assert types(out)[-3:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert parse(out)[-1]["item"]["status"] == "incomplete"
    ended: dict[str, Any] | None = events.ended
    assert ended is not None
    assert ended["status"] == "cancelled"
    assert [(i["type"], i["status"]) for i in ended["output"]] == [("message", "incomplete")]
    assert "usage" not in ended
    assert ended["error"] is None


def test_cancelled_before_a_runner_had_it() -> None:
    events, _, out = background()
    events.cancelled()
    assert events.snapshot() == {**parse(out)[0]["response"], "status": "cancelled"}


def test_a_response_not_in_the_background_is_as_before() -> None:
    events = ResponseEvents(base(), clock=lambda: 200, new_id=Ids())
    assert events.snapshot()["status"] == "in_progress"
    assert events.snapshot()["background"] is False
    completion = CompletionStream(events, events)
    out: list[bytes] = []
    completion.feed(chunk(0, "a"), out)
    completion.cancel(out)
    assert types(out)[:2] == ["response.created", "response.in_progress"]
    assert types(out)[-1] == "response.failed"  # cancelled without background: failed
