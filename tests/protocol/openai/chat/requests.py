"""What the chat request test modules share (test_request_mapping, _refusals and _hostile): a
minimal request and one with fields set, a function tool, parsing a body and checking its
refusal."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from protocol.core.errors import ApiError
from protocol.openai.chat.request import ChatRequest, parse_chat_request
from protocol.openai.errors import error_body

USER = {"role": "user", "content": "hi"}
BASE: dict[str, Any] = {"model": "m", "messages": [USER]}


def parse(obj: Any) -> ChatRequest:
    return parse_chat_request(orjson.dumps(obj))


def request(**fields: Any) -> dict[str, Any]:
    """BASE with `fields` set (a value of ... removes the field)."""
    body = {**BASE, **fields}
    return {key: value for key, value in body.items() if value is not ...}


def refusal(obj: Any) -> ApiError:
    data = obj if isinstance(obj, bytes) else orjson.dumps(obj)
    with pytest.raises(ApiError) as info:
        parse_chat_request(data)
    err = info.value
    assert err.status == 400
    assert err.type == "invalid_request_error"
    assert error_body(err) == {
        "error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    }
    return err


FN = {"type": "function", "function": {"name": "f"}}


def fn(**fields: Any) -> dict[str, Any]:
    """A function tool named "f" with `fields` set in its function (... removes one)."""
    function = {k: v for k, v in {"name": "f", **fields}.items() if v is not ...}
    return {"type": "function", "function": function}
