"""Compaction on a local model (protocol.openai.responses.compaction): the request that asks
for the summary, the compaction item that carries it, and a later input that gives it back."""

from __future__ import annotations

import base64
import itertools

import orjson
import pytest

from protocol.core.errors import ApiError
from protocol.frames import Message
from protocol.openai.responses.compaction import (
    COMPACTION_PROMPT,
    MAX_SUMMARY_TOKENS,
    SUMMARY_PREFIX,
    compacted_output,
    decode_summary,
    encode_summary,
)
from protocol.openai.responses.input import parse_input
from protocol.openai.responses.request import ResponsesRequest, parse_compact_request


def compact(**fields: object) -> ResponsesRequest:
    return parse_compact_request(orjson.dumps({"model": "m", **fields}), store=True)


def test_the_summary_goes_through_its_item_unchanged() -> None:
    summary = 'They want the weather in Paris; get_weather said "Sunny". Open: nothing. é'
    content = encode_summary(summary)
    assert decode_summary(content, "x") == summary
    assert "Paris" not in content  # opaque to clients


@pytest.mark.parametrize(
    "content",
    [
        "not base64 at all!",
        base64.urlsafe_b64encode(b"someone-elses-compaction").decode(),
        base64.urlsafe_b64encode(b'orchard-compaction-v1:{"summary": 1}').decode(),
        base64.urlsafe_b64encode(b"orchard-compaction-v1:{not json").decode(),
    ],
)
def test_a_compaction_not_made_here_is_a_400_naming_it(content: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_input([{"type": "compaction", "encrypted_content": content}])
    err = caught.value
    assert (err.status, err.param, err.code) == (400, "input[0].encrypted_content", "invalid_value")


def test_a_compaction_item_is_its_summary_for_the_model() -> None:
    item = {"type": "compaction", "id": "cmp_1", "encrypted_content": encode_summary("S.")}
    messages = parse_input([item, {"role": "user", "content": "And now?"}])
    assert messages == (Message("user", SUMMARY_PREFIX + "S."), Message("user", "And now?"))


def test_the_output_keeps_the_users_words_and_adds_the_summary() -> None:
    counter = itertools.count()
    conversation = (
        Message("user", "Plan a trip."),
        Message("assistant", "Where to?"),
        Message("user", SUMMARY_PREFIX + "an older summary"),  # compacted before: not kept
        Message("user", "Paris."),
    )
    output = compacted_output(conversation, "Trip to Paris.", lambda p: f"{p}_{next(counter)}")
    assert output[:-1] == [
        {
            "id": f"msg_{i}",
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": text}],
            "status": "completed",
        }
        for i, text in enumerate(("Plan a trip.", "Paris."))
    ]
    assert output[-1]["type"] == "compaction"
    assert output[-1]["id"] == "cmp_2"
    assert decode_summary(output[-1]["encrypted_content"], "x") == "Trip to Paris."


def test_the_request_asks_for_the_summary_after_the_conversation() -> None:
    request = compact(input="Plan a trip.", instructions="Be brief.")
    generate = request.to_generate("r")
    assert generate.messages == (
        Message("system", "Be brief."),
        Message("user", "Plan a trip."),
        Message("user", COMPACTION_PROMPT),
    )
    assert generate.max_tokens == MAX_SUMMARY_TOKENS
    chained = compact(previous_response_id="resp_1")
    assert chained.input == (Message("user", COMPACTION_PROMPT),)


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({}, "input", "missing_required_parameter"),
        ({"input": "x", "tools": []}, "tools", "unknown_parameter"),
        ({"input": "x", "max_output_tokens": 16}, "max_output_tokens", "unknown_parameter"),
    ],
)
def test_compact_takes_only_its_fields(fields: dict[str, object], param: str, code: str) -> None:
    with pytest.raises(ApiError) as caught:
        compact(**fields)
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, param, code)
