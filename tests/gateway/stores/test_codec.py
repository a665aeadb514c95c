"""The stored values' codec (gateway.stores.codec): the stores' value classes round-trip (bytes
fields, Messages with tool calls, any text), and a class that gains a field with a default
reads what it wrote before and carries the new field, with no change to the codec."""

from __future__ import annotations

import attrs
from hypothesis import given
from hypothesis import strategies as st

from gateway.stores.chat import StoredCompletion
from gateway.stores.codec import Codec
from gateway.stores.responses import StoredResponse
from protocol.frames import Message, ToolCall

tool_calls = st.builds(ToolCall, st.text(), st.text(), st.text())
messages = st.builds(
    Message,
    st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
    st.text(),
    name=st.none() | st.text(),
    tool_calls=st.tuples() | st.tuples(tool_calls) | st.tuples(tool_calls, tool_calls),
    tool_call_id=st.none() | st.text(),
    reasoning=st.none() | st.text(),
)
pairs = st.tuples(st.text(), st.binary())


@given(
    st.builds(
        StoredResponse,
        st.text(),
        st.binary(),
        st.lists(messages, max_size=4).map(tuple),
        st.lists(pairs, max_size=4).map(tuple),
    )
)
def test_a_stored_response_round_trips(value: StoredResponse) -> None:
    codec = Codec(StoredResponse)
    assert codec.decode(codec.encode(value)) == value


@given(
    st.builds(
        StoredCompletion,
        st.text(),
        st.text(),
        st.integers(0, 2**40),
        st.integers(0, 2**40),
        st.dictionaries(st.text(), st.text(), max_size=4),
        st.binary(),
        st.lists(pairs, max_size=4),
    )
)
def test_a_stored_completion_round_trips(value: StoredCompletion) -> None:
    codec = Codec(StoredCompletion)
    assert codec.decode(codec.encode(value)) == value


@attrs.define
class Before:
    id: str
    body: bytes
    conversation: tuple[Message, ...] = ()


@attrs.define
class After:
    """`Before` with fields added later, as StoredResponse gains `events`."""

    id: str
    body: bytes
    conversation: tuple[Message, ...] = ()
    events: tuple[bytes, ...] = ()
    status: str | None = None


def test_a_field_added_later_needs_no_change_to_the_codec() -> None:
    old = Before("resp_1", b"\x00{}", (Message("user", "hi"),))
    written_before = Codec(Before).encode(old)
    # A row written before the field existed reads with its default.
    assert Codec(After).decode(written_before) == After("resp_1", b"\x00{}", old.conversation)
    new = After("resp_2", b"{}", (), events=(b"event: a\n\n", b"\xff"), status="failed")
    assert Codec(After).decode(Codec(After).encode(new)) == new
    # A row from a newer gateway reads on an older one: the field it does not know is left.
    assert Codec(Before).decode(Codec(After).encode(new)) == Before("resp_2", b"{}", ())


def test_bytes_are_base64_in_the_json() -> None:
    assert Codec(Before).encode(Before("r", b"\xff\x00")) == (
        b'{"id":"r","body":"/wA=","conversation":[]}'
    )
