"""The chaos soak's dialects: each request's body, and a parser that turns what came back into
one `Transcript`, checked event by event; then `judge` says what the stream's outcome was.

Pure: no I/O here (bench/chaos_client.py reads the sockets). Every dialect asks for `tokens`
tokens of the scripted engine, whose answer is "tok0 tok1 ... tok{n-1} ", and ends on its
token limit: chat `finish_reason: "length"`, Anthropic `stop_reason: "max_tokens"`, Responses
`response.incomplete` (`max_output_tokens`), the browser socket's `done` with `length`. A
parser records the text pieces in order, how the stream ended (`FINISH`, `ERROR`, or nothing:
cut), the finish reason or error code, the usage's completion tokens, and the first breach of
the dialect's own framing it saw (`problem`: a malformed event, events after the end, a gap in
Responses' sequence numbers, a finish without usage, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson

MODEL = "chaos"
FIREHOSE = "chaos-firehose"
"""The slow readers' model, on a runner of its own that writes as fast as it can, so that
thousands of tokens pile up behind a reader's pause (more than the kernel's socket buffers
hold), and the gateway has to merge them."""

CHAT, ANTHROPIC, RESPONSES, BROWSER = "chat", "anthropic", "responses", "browser"
DIALECTS = (CHAT, ANTHROPIC, RESPONSES, BROWSER)
SSE_PATHS = {CHAT: "/v1/chat/completions", ANTHROPIC: "/v1/messages", RESPONSES: "/v1/responses"}

NORMAL, DISCONNECT, SLOW = "normal", "disconnect", "slow"
"""What the client does: read it all, hang up after some tokens, or read with long pauses."""

FINISH, ERROR, CUT, OURS, NO_CONNECTION = "finish", "error", "cut", "ours", "no connection"
"""How a stream ended: its dialect's normal end, its error event, the connection dropped, we
hung up on purpose, or no connection at all (refused)."""

LENGTH, STOPPED = "length", "stopped"
"""Finish reasons, the same in every dialect: the token limit, or cut short by the runner
(a drain deadline: chat's "stop" with the usage of what was sent, the socket's "cancelled")."""

REFUSALS = frozenset({"queue_full", "model_unavailable", "shutting_down", "too_many_requests"})
"""Browser-socket error codes that, before any chunk, mean "refused: try again later"."""

# The outcomes, in the order the report lists them.
COMPLETE = "complete and exact"
CLEAN_ERROR = "clean error after a correct prefix"
REFUSED = "refused (429/503 + Retry-After)"
DOWN = "cut while the gateway was down"
HUNG_UP = "client hung up (on purpose)"
VIOLATION = "violation"
OUTCOMES = (COMPLETE, CLEAN_ERROR, REFUSED, DOWN, HUNG_UP, VIOLATION)


def expected(tokens: int) -> str:
    return "".join(f"tok{i} " for i in range(tokens))


def body(dialect: str, tokens: int, n: int, model: str = MODEL) -> dict[str, Any]:
    """The request of one stream (the n-th: its prompt differs from the others')."""
    messages = [{"role": "user", "content": f"chaos request {n}"}]
    if dialect == ANTHROPIC:
        return {"model": model, "messages": messages, "max_tokens": tokens, "stream": True}
    if dialect == RESPONSES:
        # store: false, or the gateway would keep every response (bounded, but it would
        # read as RSS growing for the whole run).
        return {
            "model": model,
            "input": messages[0]["content"],
            "max_output_tokens": tokens,
            "stream": True,
            "store": False,
        }
    return {
        "model": model,
        "messages": messages,
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclasses.dataclass
class Transcript:
    """One stream as the client saw it."""

    dialect: str
    behaviour: str
    tokens: int
    """Tokens asked for."""
    started: float
    ended: float = 0.0
    status: int = 0
    """The HTTP status (101 for the browser socket), 0 when there was no answer."""
    retry_after: bool = False
    pieces: list[str] = dataclasses.field(default_factory=list)
    end: str = CUT
    code: str | None = None
    """The finish reason (LENGTH, STOPPED, or the dialect's own) or the error code."""
    usage: int | None = None
    problem: str | None = None
    seen: int = 0
    """Events parsed (for Responses: the next sequence number expected)."""
    merged: bool = False
    """Some piece carried more than one token (the gateway merged chunks for a slow reader)."""

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def over(self) -> bool:
        return self.end in (FINISH, ERROR) or self.problem is not None

    def add(self, piece: str | None) -> None:
        if not piece:
            return
        if self.end != CUT:
            self.fail("text after the end")
        self.pieces.append(piece)
        self.merged = self.merged or piece.count("tok") > 1

    def fail(self, problem: str) -> None:
        if self.problem is None:
            self.problem = problem

    def finish(self, end: str, code: str | None) -> None:
        if self.end != CUT:
            self.fail(f"a second end ({end} {code}) after {self.end} {self.code}")
            return
        self.end, self.code = end, code


def parse_sse(t: Transcript, block: bytes) -> bool:
    """Feed one SSE event (a block without its blank line); True once the stream has ended
    (its terminal event, or a problem)."""
    event = b""
    data = None
    for line in block.split(b"\n"):
        if line.startswith(b"event: "):
            event = line[7:]
        elif line.startswith(b"data: "):
            data = line[6:]
        elif line and not line.startswith(b":"):
            t.fail(f"malformed SSE line {line[:40]!r}")
    if data is None:
        if event:
            t.fail("an event with no data")
        return t.over  # a comment (keep-alive)
    t.seen += 1
    if t.dialect == CHAT:
        return _chat(t, data)
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        t.fail("malformed JSON")
        return True
    if obj.get("type") != event.decode():
        t.fail(f"event {event!r} carries type {obj.get('type')!r}")
    if t.dialect == ANTHROPIC:
        _anthropic(t, obj)
    else:
        _responses(t, obj)
    return t.over


def _chat(t: Transcript, data: bytes) -> bool:
    if data == b"[DONE]":
        if t.end == CUT:
            t.fail("[DONE] with no finish or error")
        elif t.end == FINISH and t.usage is None:
            t.fail("a finish with no usage chunk (include_usage)")
        t.seen = -1  # [DONE] seen: nothing may follow
        return True
    if t.seen < 0:
        t.fail("an event after [DONE]")
        return True
    obj = orjson.loads(data)
    if "error" in obj:
        t.finish(ERROR, obj["error"].get("code"))
        return False  # [DONE] follows
    if obj.get("usage"):
        if t.end != FINISH:
            t.fail("usage before the finish")
        t.usage = obj["usage"]["completion_tokens"]
    for choice in obj["choices"]:
        t.add(choice["delta"].get("content"))
        if reason := choice["finish_reason"]:
            t.finish(FINISH, {"length": LENGTH, "stop": STOPPED}.get(reason, reason))
    return False


def _anthropic(t: Transcript, obj: dict[str, Any]) -> None:
    kind = obj["type"]
    if t.seen == 1 and kind != "message_start":
        t.fail(f"{kind} before message_start")
    if kind == "content_block_delta":
        t.add(obj["delta"].get("text"))
    elif kind == "message_delta":
        reason = obj["delta"]["stop_reason"]
        t.code = {"max_tokens": LENGTH}.get(reason, reason)
        t.usage = obj["usage"]["output_tokens"]
    elif kind == "message_stop":
        if t.usage is None:
            t.fail("message_stop with no message_delta")
        t.finish(FINISH, t.code)
    elif kind == "error":
        t.finish(ERROR, obj["error"]["type"])


def _responses(t: Transcript, obj: dict[str, Any]) -> None:
    if obj.get("sequence_number") != t.seen - 1:
        t.fail(f"sequence_number {obj.get('sequence_number')} where {t.seen - 1} was due")
    kind = obj["type"]
    if kind == "response.output_text.delta":
        t.add(obj["delta"])
    elif kind == "response.output_text.done" and obj["text"] != t.text:
        t.fail("output_text.done differs from its deltas")
    elif kind in ("response.completed", "response.incomplete"):
        response = obj["response"]
        reason = (response.get("incomplete_details") or {}).get("reason")
        t.usage = response["usage"]["output_tokens"]
        t.finish(FINISH, LENGTH if reason == "max_output_tokens" else reason or "completed")
    elif kind == "response.failed":
        t.finish(ERROR, obj["response"]["error"]["code"])


def parse_browser(t: Transcript, message: dict[str, Any]) -> bool:
    """Feed one message of the browser socket about this request; True once it has ended."""
    t.seen += 1
    kind = message.get("type")
    if kind == "chunk":
        chunk = message["chunk"]
        for choice in chunk["choices"]:
            t.add(choice["delta"].get("content"))
        if chunk.get("usage") and chunk["choices"]:
            t.fail("usage in a chunk with choices")
    elif kind == "done":
        reason = message["finish_reason"]
        t.usage = message["usage"]["completion_tokens"]
        t.finish(FINISH, {"length": LENGTH, "cancelled": STOPPED}.get(reason, reason))
    elif kind == "error":
        t.finish(ERROR, message["error"].get("code"))
    else:
        t.fail(f"unexpected message {kind!r}")
    return t.over


def judge(t: Transcript, gateway_down: bool) -> tuple[str, str]:
    """(outcome, detail) of one stream; `gateway_down`: its life overlapped a window in which
    the gateway was stopped or starting."""
    text = t.text
    if t.problem is not None:
        return VIOLATION, t.problem
    if not expected(t.tokens).startswith(text):
        return VIOLATION, "wrong text: a token lost, repeated or reordered"
    if t.status in (429, 503):
        why = f"HTTP {t.status} {t.code}"
        return (REFUSED, why) if t.retry_after else (VIOLATION, f"{why} with no Retry-After")
    if t.status == 404:
        return VIOLATION, f"HTTP 404 {t.code}"
    if t.status not in (0, 101, 200):
        if t.status in (502, 504) and t.code is not None:
            return CLEAN_ERROR, f"HTTP {t.status} {t.code}"
        return VIOLATION, f"HTTP {t.status} {t.code}"
    if t.end == FINISH:
        return _finished(t, text)
    if t.end == ERROR:
        if t.dialect == BROWSER and not text and t.code in REFUSALS:
            return REFUSED, f"error {t.code}"
        if t.code == "model_not_found":
            return VIOLATION, f"error {t.code}"
        return CLEAN_ERROR, f"error {t.code}"
    if t.end == OURS:
        return HUNG_UP, t.behaviour
    if gateway_down:
        return DOWN, t.end
    return VIOLATION, f"{t.end} while the gateway was up ({len(t.pieces)} pieces in)"


def _finished(t: Transcript, text: str) -> tuple[str, str]:
    streamed = text.count("tok")
    if t.usage != streamed:
        return VIOLATION, f"usage {t.usage} for {streamed} tokens streamed"
    if t.code == LENGTH and streamed == t.tokens:
        return COMPLETE, t.behaviour
    if t.code == STOPPED and streamed < t.tokens:
        return CLEAN_ERROR, "cut short by a drain deadline"
    return VIOLATION, f"finish {t.code} after {streamed} of {t.tokens} tokens"
