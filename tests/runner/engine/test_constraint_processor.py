"""Constrained decoding's logits processor on the demo model's real tokenizer, token by token:
only tokens that keep the text valid, a refused token, a batch's rows masked together, and
apply_bitmask."""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from protocol.frames import ResponseFormat
from runner.engine.masking import BatchConstraints, apply_bitmask
from tests.runner.engine.constraint_cases import allowed, compile_for, schema_format
from tests.runner.engines import Reference


@pytest.fixture(scope="module")
def tokenizer(reference: Reference) -> Any:
    """The demo model's mlx-lm tokenizer."""
    return reference.tokenizer


# The processor, token by token.


def _token_bytes(tokenizer: Any) -> dict[int, bytes]:
    """Each ordinary token's bytes (the demo tokenizer is a byte-level BPE)."""
    table = _byte_level_table()
    added = set(tokenizer._tokenizer.added_tokens_decoder)  # markers: not byte-level text
    return {
        i: bytes(table[c] for c in token)
        for token, i in tokenizer.get_vocab().items()
        if i not in added
    }


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-to-character table, reversed."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def test_the_processor_allows_only_tokens_that_keep_the_text_valid(tokenizer: Any) -> None:
    # A schema with three possible documents, walked token by token along one of them. At
    # every step: no token is allowed whose bytes would leave the three documents (checked
    # over the whole vocabulary), the document's own next token is allowed, and once it is
    # complete only the end-of-sequence tokens are. llguidance may refuse a valid but odd
    # spelling of forced text (" " then '"' where the BPE has ' "'), so the allowed set can
    # be smaller than every valid extension; where the documents part ways, it has a token
    # for each.
    schema = {
        "type": "object",
        "properties": {"a": {"enum": ["yes", "no", "yesterday"]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    documents = [json.dumps({"a": value}).encode() for value in ("yes", "no", "yesterday")]
    constraint = compile_for(tokenizer, response_format=schema_format(schema))
    processor = constraint.processor()
    vocab = len(tokenizer)
    pieces = _token_bytes(tokenizer)
    eos = set(tokenizer.eos_token_ids)
    # The tokens mlx-lm passes start wherever the prefix cache left off: only the last one of a
    # later call is new.
    context = list(tokenizer.encode("any prompt at all", add_special_tokens=False))
    written = b""
    for token in tokenizer.encode(documents[2].decode(), add_special_tokens=False):
        ways = [d for d in documents if d.startswith(written)]
        valid = {
            t for t, piece in pieces.items() if any(d.startswith(written + piece) for d in ways)
        }
        now = allowed(processor, context, vocab)
        assert token in now <= valid | (eos if written in documents else set()), written
        if written == b'{"a": "':
            assert {pieces[t][:1] for t in now} == {b"y", b"n"}
        if written == documents[0]:  # "yes" is complete, "yesterday" goes on
            assert eos <= now
        context.append(token)
        written += pieces[token]
    assert written == documents[2]
    assert allowed(processor, context, vocab) == eos
    assert processor.error is None


def test_a_refused_token_leaves_only_the_end_and_says_why(tokenizer: Any) -> None:
    constraint = compile_for(tokenizer, response_format=ResponseFormat("json_object"))
    processor = constraint.processor()
    vocab = len(tokenizer)
    context = [5]
    pieces = _token_bytes(tokenizer)
    first = allowed(processor, context, vocab)
    assert first
    assert all(pieces[t].startswith(b"{") for t in first)
    (letter,) = tokenizer.encode("x", add_special_tokens=False)
    assert allowed(processor, [*context, letter], vocab) == set(tokenizer.eos_token_ids)
    assert processor.error is not None
    assert processor.error.startswith(f"the grammar refused token {letter}")
    # Fresh processors start over.
    assert constraint.processor().error is None


def test_a_batch_masks_its_constrained_rows_together(tokenizer: Any) -> None:
    # Three rows: uid 8 unconstrained, 7 and 9 under json_object; 9 then takes a token the
    # grammar refuses. The logits are 4 wider than the tokenizer's vocabulary (a padded
    # embedding): constrained rows refuse those, the free row keeps them.
    constraint = compile_for(tokenizer, response_format=ResponseFormat("json_object"))
    batch = BatchConstraints()
    rows = {7: constraint.processor(), 9: constraint.processor()}
    for uid, processor in rows.items():
        batch.add(uid, processor)
    vocab = len(tokenizer) + 4
    logits = mx.zeros((3, 1, vocab))
    pieces = _token_bytes(tokenizer)

    def kept(masked: Any, row: int) -> set[int]:
        return set(np.flatnonzero(np.array(masked)[row, 0] > -np.inf).tolist())

    # The rows' first step: the tokens given are the prompts' last, not consumed.
    first = batch.mask([8, 7, 9], mx.array([5, 5, 5]), logits)
    assert kept(first, 0) == set(range(vocab))
    assert kept(first, 1) == kept(first, 2)
    assert kept(first, 1)
    assert all(pieces[t].startswith(b"{") for t in kept(first, 1))
    (brace,) = tokenizer.encode("{", add_special_tokens=False)
    (letter,) = tokenizer.encode("x", add_special_tokens=False)
    second = batch.mask([8, 7, 9], mx.array([letter, brace, letter]), logits)
    assert kept(second, 0) == set(range(vocab))
    assert kept(second, 1)
    assert {pieces[t][:1] for t in kept(second, 1)} <= {b'"', b"}"}
    assert kept(second, 2) == set(tokenizer.eos_token_ids)
    assert rows[7].error is None
    assert rows[9].error is not None
    assert rows[9].error.startswith(f"the grammar refused token {letter}")
    # A step without constrained rows is the model's own logits, and so is any call that is
    # not mlx-lm's generation step (a prefill chunk): the wrapped model passes it through.
    head = logits[:1]
    assert batch.mask([8], mx.array([1]), head) is head
    wrapped = batch.wrap(lambda inputs, cache=None: logits)
    assert wrapped(mx.array([[1], [2], [3]]), cache=None) is logits
    assert rows[7].error is None  # nothing consumed


def test_apply_bitmask_keeps_the_dtype_and_refuses_tokens_past_the_mask() -> None:
    bitmask = np.zeros((1, 2), dtype=np.int32)
    bitmask[0, 0] = 0b1010  # tokens 1 and 3
    bitmask[0, 1] = np.int32(-(2**31))  # token 63, the sign bit
    logits = mx.arange(70, dtype=mx.bfloat16).reshape(1, 70)
    masked = apply_bitmask(logits, bitmask)
    assert masked.dtype == mx.bfloat16
    kept = np.flatnonzero(np.array(masked.astype(mx.float32)[0]) > -np.inf)
    assert kept.tolist() == [1, 3, 63]  # 64..69 are past the mask: refused
    assert np.array(masked.astype(mx.float32))[0, 3] == 3
    narrow = apply_bitmask(mx.zeros((1, 2)), bitmask)
    assert np.array(narrow)[0].tolist() == [-np.inf, 0.0]
