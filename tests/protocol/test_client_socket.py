"""The messages every client socket reads the same way (`load`) and the first-message
authentication (`AuthGate`), with no event loop."""

from __future__ import annotations

from typing import Any

import pytest

from protocol.client_socket import AUTH_OK, AuthGate, CloseSocket, load
from protocol.core.errors import ApiError
from protocol.openai.errors import error_body
from tests.protocol.bad_input import BAD_JSON


def _error(err: ApiError) -> dict[str, Any]:
    assert err.status == 400
    body: dict[str, Any] = error_body(err)["error"]
    return body


def test_load_takes_an_object_with_a_string_type() -> None:
    assert load(b'{"type": "x", "a": [1]}', 100) == {"type": "x", "a": [1]}
    assert load('{"type": "x"}', 100) == {"type": "x"}


@pytest.mark.parametrize("data", [b"x" * 11, "x" * 11, "é" * 6, "\ud800" * 4])
def test_load_measures_bytes(data: bytes | str) -> None:
    size = len(data) if isinstance(data, bytes) else len(data.encode(errors="surrogatepass"))
    with pytest.raises(ApiError) as caught:
        load(data, 10)
    assert _error(caught.value) == {
        "message": f"Message of {size} bytes is over the 10-byte limit.",
        "type": "invalid_request_error",
        "param": None,
        "code": "message_too_large",
    }


def test_load_takes_a_message_of_exactly_the_limit() -> None:
    data = '{"type":"é"}'
    assert load(data, len(data.encode())) == {"type": "é"}


@pytest.mark.parametrize(("data", "message"), BAD_JSON)
def test_load_refuses_bad_json(data: bytes, message: str) -> None:
    with pytest.raises(ApiError) as caught:
        load(data, 100)
    assert _error(caught.value) == {
        "message": message,
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_json",
    }


def test_load_refuses_lone_surrogates_as_bad_json() -> None:
    with pytest.raises(ApiError) as caught:
        load('{"type": "\ud800"}', 100)
    assert caught.value.code == "invalid_json"


@pytest.mark.parametrize(
    "data", [b"[1, 2]", b"null", b'"ping"', b"{}", b'{"type": 7}', b'{"type": null}']
)
def test_load_refuses_what_is_not_a_message(data: bytes) -> None:
    with pytest.raises(ApiError) as caught:
        load(data, 100)
    assert _error(caught.value) == {
        "message": "A message must be a JSON object with a string 'type'.",
        "type": "invalid_request_error",
        "param": "type",
        "code": "invalid_message",
    }


def gate() -> AuthGate:
    return AuthGate(lambda key: key == "right")


def test_a_gate_without_a_key_to_check_is_open() -> None:
    open_gate = AuthGate(None)
    assert not open_gate.waiting
    assert open_gate.timed_out() is None


def test_the_right_key_opens_the_gate() -> None:
    g = gate()
    assert g.waiting
    assert g.admit({"type": "auth", "api_key": "right"}) == AUTH_OK == b'{"type":"auth.ok"}'
    assert not g.waiting
    assert g.timed_out() is None


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        ({"type": "auth", "api_key": "wrong"}, "invalid API key"),
        ({"type": "auth", "api_key": 12}, "invalid API key"),
        ({"type": "auth"}, "invalid API key"),
        ({"type": "response.create"}, "authenticate first"),
    ],
)
def test_anything_else_closes_the_gate(obj: dict[str, Any], reason: str) -> None:
    g = gate()
    assert g.admit(obj) == CloseSocket(4004, reason)
    assert g.closed
    assert g.timed_out() is None  # refused once


def test_an_auth_with_unknown_fields_is_answered_and_the_gate_still_waits() -> None:
    g = gate()
    with pytest.raises(ApiError) as caught:
        g.admit({"type": "auth", "api_key": "right", "user": "me"})
    assert caught.value.code == "unknown_parameter"
    assert g.waiting
    assert g.timed_out() == CloseSocket(4004, "no auth message in time")
