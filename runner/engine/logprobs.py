"""Log-probabilities of generated tokens, in OpenAI's shape (`TokenLogprob`).

The values are the model's own: mlx-lm hands each step's log-softmax of the logits it sampled
from, after the request's logit processors (logit bias, penalties, a grammar's mask) and
before temperature, as OpenAI reports them. Only requests that ask for logprobs pay for this:
one gather, and a partial sort for `top_logprobs`.

A token's `bytes` are its raw bytes, which may be part of a UTF-8 character; its `token`
string is those bytes decoded with replacement characters.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    _byte_decoder,
)

from protocol.frames import PromptToken, TokenLogprob, TopLogprob


class TokenBytes:
    """Each token id's raw bytes, worked out once per id from the tokenizer's own vocabulary
    (byte-level BPE and SentencePiece byte tokens map to the bytes they stand for)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        detokenizer = tokenizer.detokenizer
        self._tokenmap: list[Any] | None = getattr(detokenizer, "tokenmap", None)
        self._kind = (
            "bpe"
            if isinstance(detokenizer, BPEStreamingDetokenizer)
            else "spm"
            if isinstance(detokenizer, SPMStreamingDetokenizer)
            else "text"
        )
        self._cache: dict[int, tuple[str, tuple[int, ...]]] = {}

    def __call__(self, token: int) -> tuple[str, tuple[int, ...]]:
        """(token string, bytes) of a token id."""
        found = self._cache.get(token)
        if found is not None:
            return found
        raw = self._raw(token)
        found = self._cache[token] = (raw.decode("utf-8", "replace"), tuple(raw))
        return found

    def _raw(self, token: int) -> bytes:
        tokenmap = self._tokenmap
        if tokenmap is not None and token < len(tokenmap):
            entry = tokenmap[token]
            if self._kind == "bpe":
                decoder = _byte_decoder()
                return bytes(
                    b
                    for char in entry
                    for b in ((decoder[char],) if char in decoder else char.encode())
                )
            if self._kind == "spm":
                return bytes(entry).replace(b"\xe2\x96\x81", b" ")
        text: str = self._tokenizer.decode([token])
        return text.encode()


class LogprobMaker:
    """Builds the `TokenLogprob` of each generated token of one request."""

    def __init__(self, token_bytes: TokenBytes, top: int) -> None:
        self._bytes = token_bytes
        self._top = top

    def __call__(self, token: int, logprobs: Any) -> TokenLogprob:
        """`logprobs`: the step's log-probabilities over the vocabulary (1-D)."""
        vector = logprobs.reshape(-1)
        top: tuple[TopLogprob, ...] = ()
        if self._top:
            k = min(self._top, vector.shape[0])
            ids = mx.argpartition(-vector, k - 1)[:k]
            values = vector[ids]
            mx.eval(ids, values)
            id_list: list[int] = ids.tolist()  # type: ignore[assignment]  # 1-D: a list of ints
            value_list: list[float] = values.tolist()
            pairs = sorted(zip(value_list, id_list, strict=True), key=lambda p: -p[0])
            top = tuple(TopLogprob(*self._entry(i, v)) for v, i in pairs)
        value = float(vector[token].item())
        return TokenLogprob(*self._entry(token, value), top)

    def _entry(self, token: int, value: float) -> tuple[str, float, tuple[int, ...]]:
        return _entry(self._bytes, token, value)


def prompt_entries(
    logprobs: Any, targets: list[int], top: int, token_bytes: TokenBytes
) -> list[PromptToken]:
    """The echoed prompt tokens `targets`, each with its logprob in the matching row of
    `logprobs` (positions x vocabulary: the log-softmax at the position before it) and the
    `top` most likely tokens there; all rows worked out at once and read back in one go."""
    chosen = mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)[:, 0]
    arrays = [chosen]
    if top:
        k = min(top, logprobs.shape[-1])
        ids = mx.argpartition(-logprobs, k - 1, axis=-1)[:, :k]
        arrays += [ids, mx.take_along_axis(logprobs, ids, axis=-1)]
    mx.eval(arrays)
    values: list[float] = chosen.tolist()  # type: ignore[assignment]  # 1-D: floats
    tops: list[tuple[TopLogprob, ...]] = [()] * len(targets)
    if top:
        id_rows: list[list[int]] = arrays[1].tolist()  # type: ignore[assignment]  # 2-D
        value_rows: list[list[float]] = arrays[2].tolist()  # type: ignore[assignment]  # 2-D
        tops = [
            tuple(
                TopLogprob(*_entry(token_bytes, i, v))
                for v, i in sorted(zip(row_values, row_ids, strict=True), key=lambda p: -p[0])
            )
            for row_ids, row_values in zip(id_rows, value_rows, strict=True)
        ]
    entries = []
    for token, value, alternatives in zip(targets, values, tops, strict=True):
        text, raw = token_bytes(token)
        entries.append(PromptToken(text, raw, _floor(value), alternatives))
    return entries


def _entry(token_bytes: TokenBytes, token: int, value: float) -> tuple[str, float, tuple[int, ...]]:
    text, raw = token_bytes(token)
    return text, _floor(value), raw


def _floor(value: float) -> float:
    # A masked token has -inf; JSON has no infinities, and OpenAI floors at about -9999.
    return max(value, -9999.0)
