"""gpt-oss's output in OpenAI's Harmony format, split into content, reasoning and tool calls.
Pure logic, no mlx.

A gpt-oss model writes its answer as a run of messages:

    <|start|>{header}<|message|>{body}<|end|>          (<|call|> or <|return|> ends the last)
    header = ROLE [to=RECIPIENT] <|channel|>CHANNEL [to=RECIPIENT] [[<|constrain|>]TYPE]

The generation prompt ends with `<|start|>assistant`, so the first message starts in its
header with no `<|start|>` of its own. The seven markers are single special tokens: they are
recognised by id, never by text (a detokenizer that skips special tokens gives them no text).
`HarmonySplitter` takes the output one token at a time and routes each message's body:

- `final` channel: content; `commentary` channel with no recipient: content too (a
  *preamble*, the plan the model tells the user before its calls; the docs say it is meant
  to be shown, unlike the chain of thought);
- a recipient `functions.NAME` (on any channel; the commentary one is the rule): a tool call,
  streamed as `ToolCallDelta`s: when the header ends, one with the call's index in the
  answer, a fresh id and NAME; then the body as the model writes it (raw JSON text, numbers
  exactly as written). `<|constrain|>json` and the content type are header, never arguments;
- any other recipient (`browser.search`, `python`: built-in tools this server does not run
  and no client could, "browser.search" not being a valid OpenAI function name): reasoning,
  as the model's own working, and not a call;
- `analysis` channel, any other channel, or none: reasoning (chain of thought is never shown
  as content, whatever the model called the channel);
- a message whose header names a role other than `assistant` (the model writing a tool's
  result or a user turn itself): dropped.

Headers never reach a stream, nor does anything outside a message body (text between
messages, after the end, a stray `<|message|>`). The model's slips are taken as it meant
them: a `<|start|>` inside a body ends that message first, and a `<|channel|>` between
messages starts a message whose `<|start|>assistant` was left out. A marker in a body that
cannot be there (`<|channel|>`, `<|constrain|>`, `<|message|>`) is dropped, the body goes
on. Text that spells a marker with ordinary tokens is ordinary text.

`reasoning_tokens` counts every token of the messages routed to reasoning, headers and
markers included: from the message's `<|start|>` (for the first message, its first token)
through its closing marker. So every token of a complete output belongs to exactly one
message or to nothing (text between messages), and is counted at most once. A message cut
off before `<|message|>` has no body and counts nowhere.

A marker token's text segment may carry text the detokenizer held back from earlier tokens (a
pending space, the rest of a character): the text before the marker belongs to the state
before it, the text after to the state after (as `runner.accounting.ReasoningSplitter`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from typing import Literal

from protocol.frames import ToolCallDelta
from runner.tool_calls import new_call_id

START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
CALL = "<|call|>"
RETURN = "<|return|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN)
"""Harmony's markers, each one special token of the gpt-oss tokenizer."""

FUNCTIONS = "functions."
"""The namespace of the request's tools in a recipient (`to=functions.get_weather`)."""

_CHANNEL_VALUE = re.compile(r"[^\s<]*")


def harmony_markers(vocab: Mapping[str, int]) -> dict[str, int] | None:
    """The ids of Harmony's markers in a tokenizer's vocabulary (text → id, added tokens
    included), or None when it lacks one of them: the model does not speak Harmony."""
    if not all(marker in vocab for marker in MARKERS):
        return None
    return {marker: vocab[marker] for marker in MARKERS}


class _State(enum.Enum):
    HEADER = enum.auto()
    BODY = enum.auto()
    BETWEEN = enum.auto()
    """Outside any message: after one ended, waiting for `<|start|>`."""


class _Route(enum.Enum):
    CONTENT = enum.auto()
    REASONING = enum.auto()
    CALL = enum.auto()
    DROP = enum.auto()


Output = tuple[str, str, list[ToolCallDelta]]
"""What a token gives: (content, reasoning, tool-call deltas)."""


class HarmonySplitter:
    """Splits a Harmony output, fed token by token, into content, reasoning and tool calls
    (the module docstring gives the rules).

    `calls` counts the tool calls started; the finish reason is "tool_calls" when it is not
    0. `stop` is "call" or "return" when the output's last message ended with `<|call|>` or
    `<|return|>` (feed the end-of-sequence token too), None while it has not (still going, or
    cut off).
    """

    def __init__(self, markers: Mapping[str, int]) -> None:
        missing = [marker for marker in MARKERS if marker not in markers]
        if missing:
            raise ValueError(f"Harmony marker ids missing: {', '.join(missing)}")
        self._markers = {markers[marker]: marker for marker in MARKERS}
        if len(self._markers) != len(MARKERS):
            raise ValueError("Harmony markers need distinct token ids")
        self.calls = 0
        self.reasoning_tokens = 0
        self.stop: Literal["call", "return"] | None = None
        self._state = _State.HEADER
        self._route = _Route.DROP
        self._header: list[str] = []
        self._header_tokens = 0
        """Tokens of the current message up to its `<|message|>`."""
        self._role_known = True
        """The header's role was given (the prompt's `<|start|>assistant`, or implied)."""
        self._index = 0
        """The index of the call being written."""

    def feed(self, token_id: int, text: str) -> Output:
        """One generated token and its text segment: what it adds to each stream."""
        marker = self._markers.get(token_id)
        if marker is None:
            # The hot path: a token of a body or of a header.
            state = self._state
            if state is _State.BODY:
                route = self._route
                if route is _Route.CONTENT:
                    return text, "", []
                if route is _Route.REASONING:
                    self.reasoning_tokens += 1
                    return "", text, []
                if route is _Route.CALL and text:
                    return "", "", [ToolCallDelta(self._index, arguments=text)]
            elif state is _State.HEADER:
                self._header.append(text)
                self._header_tokens += 1
            return "", "", []
        index = text.rfind(marker)
        before, after = (text, "") if index < 0 else (text[:index], text[index + len(marker) :])
        content: list[str] = []
        reasoning: list[str] = []
        deltas: list[ToolCallDelta] = []
        self._text(before, content, reasoning, deltas)
        self._marker(marker, deltas)
        self._text(after, content, reasoning, deltas)
        return "".join(content), "".join(reasoning), deltas

    def flush(self) -> Output:
        """Generation ended. Every body's text was sent as it came, a call cut off mid-
        arguments included (its deltas hold what the model wrote), and a cut-off header is
        no message: nothing is left to send."""
        self._state = _State.BETWEEN
        self._header = []
        return "", "", []

    def _text(
        self,
        text: str,
        content: list[str],
        reasoning: list[str],
        deltas: list[ToolCallDelta],
    ) -> None:
        """Text that came with a marker token, in the current state (no token counted)."""
        if not text:
            return
        if self._state is _State.HEADER:
            self._header.append(text)
        elif self._state is _State.BODY:
            if self._route is _Route.CONTENT:
                content.append(text)
            elif self._route is _Route.REASONING:
                reasoning.append(text)
            elif self._route is _Route.CALL:
                deltas.append(ToolCallDelta(self._index, arguments=text))

    def _marker(self, marker: str, deltas: list[ToolCallDelta]) -> None:
        state = self._state
        in_reasoning = state is _State.BODY and self._route is _Route.REASONING
        if marker == START:
            # Also ends a body the model forgot to close, or restarts a header.
            self._open(role_known=False)
            self._header_tokens = 1
        elif marker in (END, CALL, RETURN):
            if in_reasoning:
                self.reasoning_tokens += 1
            self._state = _State.BETWEEN
            self._header = []
            if marker != END:
                self.stop = "call" if marker == CALL else "return"
        elif state is _State.HEADER:
            self._header_tokens += 1
            if marker == MESSAGE:
                self._begin_body(deltas)
            else:
                self._header.append(marker)
        elif state is _State.BETWEEN:
            if marker == CHANNEL:
                # `<|start|>assistant` left out: the message starts here.
                self._open(role_known=True)
                self._header = [CHANNEL]
                self._header_tokens = 1
        elif in_reasoning:
            # A marker with no place in a body: dropped, but a token of the message.
            self.reasoning_tokens += 1

    def _open(self, *, role_known: bool) -> None:
        self._state = _State.HEADER
        self._header = []
        self._role_known = role_known
        self.stop = None

    def _begin_body(self, deltas: list[ToolCallDelta]) -> None:
        route, name = _route("".join(self._header), role_known=self._role_known)
        self._state = _State.BODY
        self._route = route
        self._header = []
        if route is _Route.REASONING:
            self.reasoning_tokens += self._header_tokens
        elif route is _Route.CALL:
            self._index = self.calls
            self.calls += 1
            deltas.append(ToolCallDelta(self._index, id=new_call_id(), name=name))


def _route(header: str, *, role_known: bool) -> tuple[_Route, str]:
    """Where a message's body goes, by its header text (markers as their text), and the
    function's name for a call. Parsed as openai-harmony's `parse_header_from_string`:
    the channel is the word after `<|channel|>`; the rest, split on whitespace, is the role
    (unless known), `to=RECIPIENT`, and the content type (`json`, `<|constrain|>json`)."""
    channel: str | None = None
    index = header.find(CHANNEL)
    if index >= 0:
        rest = header[index + len(CHANNEL) :]
        match = _CHANNEL_VALUE.match(rest)
        value = match.group() if match else ""
        channel = value or None
        header = f"{header[:index]} {rest[len(value) :]}"
    parts = header.replace(CHANNEL, " ").replace(CONSTRAIN, f" {CONSTRAIN}").split()
    if parts and not parts[0].startswith(("to=", CONSTRAIN)):
        if parts[0] == "assistant":
            parts = parts[1:]
        elif not role_known:
            return _Route.DROP, ""
    recipient = next((part[3:] for part in parts if part.startswith("to=")), None)
    if recipient is not None:
        if recipient.startswith(FUNCTIONS) and len(recipient) > len(FUNCTIONS):
            return _Route.CALL, recipient[len(FUNCTIONS) :]
        return _Route.REASONING, ""
    if channel in ("final", "commentary"):
        return _Route.CONTENT, ""
    return _Route.REASONING, ""
