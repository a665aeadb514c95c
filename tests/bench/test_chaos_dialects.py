"""The chaos soak's checks, fed streams written out here: what each outcome takes, and that a
lost, repeated or reordered token, a wrong usage or a broken framing is a violation."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from bench.chaos_dialects import (
    ANTHROPIC,
    BROWSER,
    CHAT,
    CLEAN_ERROR,
    COMPLETE,
    DOWN,
    NORMAL,
    REFUSED,
    RESPONSES,
    VIOLATION,
    Transcript,
    judge,
    parse_browser,
    parse_sse,
)


def chat(
    pieces: list[str], *, finish: str | None = "length", usage: int | None = None
) -> list[bytes]:
    def data(obj: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(obj)

    events = [
        data({"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    ]
    events += [
        data({"choices": [{"delta": {"content": p}, "finish_reason": None}]}) for p in pieces
    ]
    if finish is not None:
        events.append(data({"choices": [{"delta": {}, "finish_reason": finish}]}))
        count = sum(p.count("tok") for p in pieces) if usage is None else usage
        events.append(data({"choices": [], "usage": {"completion_tokens": count}}))
    return [*events, b"data: [DONE]"]


def anthropic(pieces: list[str], *, error: bool = False) -> list[bytes]:
    objs: list[dict[str, Any]] = [{"type": "message_start"}, {"type": "ping"}]
    objs += [
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": p}} for p in pieces
    ]
    if error:
        objs.append({"type": "error", "error": {"type": "api_error", "message": "gone"}})
    else:
        usage = {"output_tokens": sum(p.count("tok") for p in pieces)}
        objs += [
            {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": usage},
            {"type": "message_stop"},
        ]
    return [f"event: {o['type']}\ndata: ".encode() + orjson.dumps(o) for o in objs]


def responses(pieces: list[str], *, skip: int | None = None) -> list[bytes]:
    text = "".join(pieces)
    objs: list[dict[str, Any]] = [{"type": "response.created"}]
    objs += [{"type": "response.output_text.delta", "delta": p} for p in pieces]
    objs.append({"type": "response.output_text.done", "text": text})
    response = {
        "incomplete_details": {"reason": "max_output_tokens"},
        "usage": {"output_tokens": text.count("tok")},
    }
    objs.append({"type": "response.incomplete", "response": response})
    numbers = [n for n in range(len(objs) + 1) if n != skip][: len(objs)]
    return [
        f"event: {o['type']}\ndata: ".encode() + orjson.dumps({**o, "sequence_number": n})
        for o, n in zip(objs, numbers, strict=True)
    ]


def fed(dialect: str, tokens: int, events: list[bytes], *, status: int = 200) -> Transcript:
    t = Transcript(dialect, NORMAL, tokens, started=0.0, status=status)
    for event in events:
        parse_sse(t, event)
    return t


OK = ["tok0 ", "tok1 ", "tok2 tok3 "]  # the last piece merged, as for a slow reader


@pytest.mark.parametrize(
    ("dialect", "make"), [(CHAT, chat), (ANTHROPIC, anthropic), (RESPONSES, responses)]
)
def test_an_exact_stream_is_complete(dialect: str, make: Any) -> None:
    t = fed(dialect, 4, make(OK))
    assert judge(t, gateway_down=False) == (COMPLETE, NORMAL)
    assert t.merged


@pytest.mark.parametrize(
    ("pieces", "why"),
    [
        (["tok0 ", "tok2 ", "tok3 "], "lost"),
        (["tok0 ", "tok1 ", "tok1 ", "tok2 "], "repeated"),
        (["tok1 ", "tok0 ", "tok2 ", "tok3 "], "reordered"),
    ],
)
def test_a_wrong_text_is_a_violation(pieces: list[str], why: str) -> None:
    for t in (fed(CHAT, 4, chat(pieces)), fed(ANTHROPIC, 4, anthropic(pieces))):
        outcome, detail = judge(t, gateway_down=False)
        assert (outcome, detail.split(":")[0]) == (VIOLATION, "wrong text"), why


def test_a_wrong_usage_or_a_short_length_finish_is_a_violation() -> None:
    assert judge(fed(CHAT, 4, chat(OK, usage=5)), gateway_down=False) == (
        VIOLATION,
        "usage 5 for 4 tokens streamed",
    )
    assert judge(fed(CHAT, 5, chat(OK)), gateway_down=False) == (
        VIOLATION,
        "finish length after 4 of 5 tokens",
    )


def test_an_error_event_after_a_prefix_is_clean() -> None:
    error = b'data: {"error": {"message": "gone", "code": "runner_lost"}}'
    t = fed(CHAT, 4, [*chat(OK[:2], finish=None)[:-1], error, b"data: [DONE]"])
    assert judge(t, gateway_down=False) == (CLEAN_ERROR, "error runner_lost")
    t = fed(ANTHROPIC, 4, anthropic(OK[:1], error=True))
    assert judge(t, gateway_down=False) == (CLEAN_ERROR, "error api_error")
    # ... but not an error event with no [DONE] after it, nor text after the error.
    t = fed(CHAT, 4, [*chat(OK[:2], finish=None)[:-1], error, *chat(OK[2:], finish=None)[1:]])
    assert judge(t, gateway_down=False)[0] == VIOLATION


def test_a_cut_is_clean_only_while_the_gateway_was_down() -> None:
    t = fed(CHAT, 4, chat(OK)[:3])
    assert judge(t, gateway_down=True) == (DOWN, "cut")
    assert judge(t, gateway_down=False)[0] == VIOLATION


def test_a_gap_in_responses_sequence_numbers_is_a_violation() -> None:
    t = fed(RESPONSES, 4, responses(OK, skip=2))
    assert judge(t, gateway_down=False) == (VIOLATION, "sequence_number 3 where 2 was due")


def test_refusals_need_retry_after_and_a_404_is_a_violation() -> None:
    t = fed(CHAT, 4, [], status=503)
    t.code = "model_unavailable"
    assert judge(t, gateway_down=False)[0] == VIOLATION
    t.retry_after = True
    assert judge(t, gateway_down=False) == (REFUSED, "HTTP 503 model_unavailable")
    t.status, t.code = 404, "model_not_found"
    assert judge(t, gateway_down=False) == (VIOLATION, "HTTP 404 model_not_found")


def test_the_browser_socket() -> None:
    t = Transcript(BROWSER, NORMAL, 2, started=0.0, status=101)
    for message in [
        {"type": "chunk", "chunk": {"choices": [{"delta": {"content": "tok0 tok1 "}}]}},
        {"type": "done", "finish_reason": "length", "usage": {"completion_tokens": 2}},
    ]:
        parse_browser(t, message)
    assert judge(t, gateway_down=False) == (COMPLETE, NORMAL)
    refused = Transcript(BROWSER, NORMAL, 2, started=0.0, status=101)
    parse_browser(refused, {"type": "error", "error": {"code": "model_unavailable"}})
    assert judge(refused, gateway_down=False) == (REFUSED, "error model_unavailable")
    gone = Transcript(BROWSER, NORMAL, 2, started=0.0, status=101)
    parse_browser(gone, {"type": "error", "error": {"code": "model_not_found"}})
    assert judge(gone, gateway_down=False) == (VIOLATION, "error model_not_found")
