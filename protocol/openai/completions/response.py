"""A legacy text completion's answer: `text_completion` chunks (`TextCompletionWriter`)
and the non-streamed body (`text_completion_body`), with echo, logprobs and `best_of`."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

import orjson

from protocol.core.stream import CollectedChoice, CompletionBuilder
from protocol.frames import (
    Chunk,
    Echo,
    FinishReason,
    PromptToken,
    TokenLogprob,
    Usage,
)
from protocol.openai.objects import openai_finish_reason, usage_dict


class _Offsets:
    """Where each token of one choice starts in its text, in characters from the start of the
    prompt: the tokens' bytes decoded in turn (a token may end inside a character)."""

    __slots__ = ("_decoder", "position")

    def __init__(self, position: int = 0) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.position = position

    def of(self, tokens: Sequence[Sequence[int]]) -> list[int]:
        offsets = []
        for raw in tokens:
            offsets.append(self.position)
            self.position += len(self._decoder.decode(bytes(raw)))
        return offsets


class _Positions:
    """Where one choice's tokens start: the prompt's from 0, the completion's after the
    prompt's whole text (whose pieces all come before the completion)."""

    __slots__ = ("_completion", "_prompt", "_prompt_chars")

    def __init__(self) -> None:
        self._prompt = _Offsets()
        self._prompt_chars = 0
        self._completion: _Offsets | None = None

    def prompt(self, echo: Echo) -> list[int]:
        """The offsets of a piece of the prompt's tokens."""
        self._prompt_chars += len(echo.text)
        return self._prompt.of([t.bytes for t in echo.tokens])

    def completion(self, entries: Sequence[TokenLogprob]) -> list[int]:
        if self._completion is None:
            self._completion = _Offsets(self._prompt_chars)
        return self._completion.of([e.bytes for e in entries])


class _Logprobs:
    """A choice's logprobs object, being filled."""

    __slots__ = ("text_offset", "token_logprobs", "tokens", "top_logprobs")

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    @classmethod
    def of(
        cls,
        positions: _Positions,
        prompt: Echo | None,
        entries: Sequence[TokenLogprob],
        *,
        echo: bool,
    ) -> _Logprobs:
        """What a piece of a choice shows: (a piece of) the prompt's tokens, counted for the
        offsets whether echoed or not and listed with `echo`, then completion tokens."""
        logprobs = cls()
        if prompt is not None:
            offsets = positions.prompt(prompt)
            if echo:
                logprobs._add(prompt.tokens, offsets)
        if entries:
            logprobs._add(entries, positions.completion(entries))
        return logprobs

    def _add(self, entries: Sequence[TokenLogprob | PromptToken], offsets: list[int]) -> None:
        self.text_offset += offsets
        for entry in entries:
            self.tokens.append(entry.token)
            self.token_logprobs.append(entry.logprob)
            self.top_logprobs.append(_top(entry))

    def dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def _top(entry: TokenLogprob | PromptToken) -> dict[str, float] | None:
    """A position's most likely tokens and the chosen one (OpenAI: up to logprobs + 1); None
    for a token with no logprob (the prompt's first)."""
    if entry.logprob is None:
        return None
    top = {t.token: t.logprob for t in entry.top_logprobs}
    top.setdefault(entry.token, entry.logprob)
    return top


class TextCompletionWriter:
    """Renders the streamed `text_completion` objects of one request (a `ChoiceWriter`): no
    opening chunk, a chunk per runner chunk with text or logprobs (a choice's first one
    starts with the prompt, with `echo`), a finish chunk per choice, the usage chunk."""

    __slots__ = (
        "_choice_heads",
        "_end",
        "_head",
        "_positions",
        "_prefix",
        "_usage_head",
        "continuous_usage_stats",
        "echo",
        "include_usage",
        "logprobs",
    )

    def __init__(
        self,
        id: str,
        created: int,
        model: str,
        include_usage: bool = False,
        continuous_usage_stats: bool = False,
        *,
        logprobs: bool = False,
        fingerprint: str | None = None,
        prefix: bytes = b"data: ",
        suffix: bytes = b"\n\n",
        echo: bool = False,
    ) -> None:
        self.include_usage = include_usage
        self.continuous_usage_stats = continuous_usage_stats and include_usage
        self.logprobs = logprobs
        self.echo = echo
        self._head = prefix + _head(id, created, model, fingerprint)
        self._prefix = prefix
        self._choice_heads: dict[int, bytes] = {}
        self._usage_head = self._head + b',"choices":[],"usage":'
        self._end = b"}" + suffix
        self._positions: dict[int, _Positions] = {}

    def role(self, usage: Usage | None = None, index: int = 0) -> bytes:
        return b""  # text completions have no opening chunk

    def chunk(self, chunk: Chunk) -> bytes:
        index = chunk.index
        text = chunk.text
        echo = chunk.echo
        logprobs: _Logprobs | None = None
        if self.logprobs:
            positions = self._positions.get(index)
            if positions is None:
                positions = self._positions[index] = _Positions()
            logprobs = _Logprobs.of(positions, echo, chunk.logprobs, echo=self.echo)
        if echo is not None and self.echo:
            text = echo.text + text
        if not (
            text
            or (logprobs is not None and logprobs.tokens)
            or (self.continuous_usage_stats and chunk.tokens)
        ):
            return b""
        return b"".join(
            (
                self._head_of(index),
                orjson.dumps(text),
                b',"index":%d,"logprobs":' % index,
                b"null" if logprobs is None else orjson.dumps(logprobs.dict()),
                b',"finish_reason":null}]',
                self._usage(chunk.usage),
                self._end,
            )
        )

    def finish(self, reason: FinishReason, usage: Usage, index: int = 0) -> bytes:
        return b"".join(
            (
                self._head_of(index),
                b'"","index":%d,"logprobs":null,"finish_reason":"' % index,
                openai_finish_reason(reason).encode(),
                b'"}]',
                self._usage(usage),
                self._end,
            )
        )

    def usage_chunk(self, usage: Usage) -> bytes:
        if not self.include_usage:
            return b""
        return self._usage_head + orjson.dumps(usage_dict(usage)) + self._end

    def _head_of(self, index: int) -> bytes:
        head = self._choice_heads.get(index)
        if head is None:
            head = self._choice_heads[index] = self._head + b',"choices":[{"text":'
        return head

    def _usage(self, usage: Usage | None) -> bytes:
        if not self.include_usage:
            return b""
        if self.continuous_usage_stats and usage is not None:
            return b',"usage":' + orjson.dumps(usage_dict(usage))
        return b',"usage":null'


def _head(id: str, created: int, model: str, fingerprint: str | None) -> bytes:
    """A text_completion object's opening fields, without the closing brace."""
    return orjson.dumps(
        {
            "id": id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": fingerprint,
        }
    )[:-1]


def text_completion_body(
    builder: CompletionBuilder,
    *,
    id: str,
    created: int,
    model: str,
    echo: bool = False,
    logprobs: bool = False,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """The non-streaming `text_completion` of what `builder` collected; raises the request's
    error if it failed (or never finished)."""
    choices, usage = builder.result()
    return {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": [_choice(i, c, echo, logprobs) for i, c in enumerate(choices)],
        "usage": usage_dict(usage),
    }


def _choice(index: int, choice: CollectedChoice, echo: bool, logprobs: bool) -> dict[str, Any]:
    text = "".join(choice.content)
    prompt = choice.echo
    rendered = None
    if logprobs:
        rendered = _Logprobs.of(_Positions(), prompt, choice.logprobs, echo=echo).dict()
    return {
        "text": prompt.text + text if prompt is not None and echo else text,
        "index": index,
        "logprobs": rendered,
        # A choice still open when the request ended was cut short with it.
        "finish_reason": openai_finish_reason(choice.finish or "cancelled"),
    }
