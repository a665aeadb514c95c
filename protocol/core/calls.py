"""Tool calls as the runner streams them, assembled into whole calls, once for every dialect.

A runner streams a call as `ToolCallDelta`s in OpenAI's order: the call's first delta opens
it (its index, id and name), later deltas of that index carry pieces of its arguments.
`CallAssembler` joins them into `Call`s: a call is whole once a delta of another index opens
the next one, or at the end (`flush`); `assemble` does it for a finished answer. The chat's
and the Responses' bodies, Anthropic's `tool_use` blocks and Ollama's `tool_calls` (which
it streams call by call) are all made from these.

The dialects that take a call's input as a JSON object do this with one whose arguments are
not an object (a call cut short by the token limit, say): its text, as the model wrote it,
goes out as content instead (`call_text`). Nothing is dropped or made up. An object goes out
as the model wrote it, too: `call_input` hands back the arguments' own text (an
`orjson.Fragment`, which `orjson.dumps` embeds as it is), so that an integer past 64 bits or a
decimal such as `1.10` reaches the client digit for digit, never through a float.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import attrs
import orjson

from protocol.frames import ToolCallDelta


@attrs.frozen
class Call:
    """One whole tool call."""

    index: int
    id: str | None
    """None only for a call whose opening delta never came."""
    name: str
    arguments: str
    """The arguments' text, as the model wrote it."""


class CallAssembler:
    """Joins one choice's tool-call deltas into whole calls (see the module docstring)."""

    __slots__ = ("_open",)

    def __init__(self) -> None:
        self._open: dict[int, tuple[list[str | None], list[str]]] = {}
        """Index → ([id, name], argument pieces) of the calls not yet whole."""

    def feed(self, deltas: Iterable[ToolCallDelta]) -> list[Call]:
        """Take deltas; the calls they made whole (those before a newly opened index)."""
        done: list[Call] = []
        for delta in deltas:
            call = self._open.get(delta.index)
            if call is None:
                done += self.flush(before=delta.index)
                self._open[delta.index] = ([delta.id, delta.name], [delta.arguments])
                continue
            head, pieces = call
            if delta.id is not None:
                head[0] = delta.id
            if delta.name is not None:
                head[1] = delta.name
            pieces.append(delta.arguments)
        return done

    def flush(self, before: int | None = None) -> list[Call]:
        """The calls not yet given out (those with an index below `before`), by index."""
        done: list[Call] = []
        for index in sorted(self._open):
            if before is not None and index >= before:
                continue
            (call_id, name), pieces = self._open.pop(index)
            done.append(Call(index, call_id, name or "", "".join(pieces)))
        return done


def assemble(deltas: Iterable[ToolCallDelta]) -> list[Call]:
    """A finished answer's tool calls, whole, by index."""
    assembler = CallAssembler()
    return assembler.feed(deltas) + assembler.flush()


def call_input(arguments: str) -> orjson.Fragment | None:
    """A call's arguments as a JSON object to embed, or None when they are not one."""
    try:
        # The standard library's parser: orjson's turns an integer past 64 bits into a float
        # (or refuses it), and this only checks the text, which goes out unchanged.
        parsed = json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):
        return None
    if type(parsed) is not dict:
        return None
    return orjson.Fragment(arguments.strip())


def call_text(name: str, arguments: str) -> str:
    """A call that cannot be a structured one, as text: `{"name": ..., "arguments": ...}`
    with the arguments as the model wrote them."""
    return f'{{"name": {orjson.dumps(name).decode()}, "arguments": {arguments}}}'
