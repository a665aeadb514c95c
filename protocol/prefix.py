"""The prefix hashes of a request: how the gateway finds the runner that holds a conversation,
without a tokenizer.

A chat request's prompt is its chat template applied to, in order: the tools (unless
`tool_choice` is "none", which hides them), the template's variables and whether thinking is
on, then each message. `prefix_chain` hashes that as a chain: the head first, then each
message with the hash before it, so the i-th hash names everything up to and including the
i-th message. Two requests with the same i-th hash start with the same i messages, so their
prompts (almost always: a template may render an earlier turn differently once it is no
longer the last) share those messages' tokens, and the KV cache one of them left on a runner
serves the other.

A raw prompt (legacy completions) is hashed in blocks of `RAW_BLOCK` characters, or of
`RAW_TOKENS` token ids: small enough that what a prompt shares with an earlier one is
counted to within a block (with blocks of 1024 characters a prompt that went on from a
1,600-character one was credited with 1,024 of them, and a runner measured at a third of
another's prefill speed lost the conversation it held).

Each hash comes with the prompt characters it covers, from which the gateway estimates the
tokens a runner holding it would not have to prefill.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

import attrs
import orjson

from protocol.frames import Generate, Message

RAW_BLOCK = 256
"""Characters of a raw text prompt per hash."""
RAW_TOKENS = 64
"""Token ids of a raw token prompt per hash."""
HASH_BYTES = 8
MAX_HASHES = 512
"""A request's chain is cut after this many (its first messages are what is shared)."""


@attrs.frozen
class PrefixChain:
    """A request's prefix hashes and, for each, the prompt characters up to its end."""

    hashes: tuple[str, ...]
    chars: tuple[int, ...]

    @property
    def total_chars(self) -> int:
        return self.chars[-1] if self.chars else 0


def prefix_chain(generate: Generate) -> PrefixChain:
    """The chain of `generate`'s prefix hashes (see the module docstring)."""
    hashes: list[str] = []
    chars: list[int] = []
    previous = b""
    total = 0
    for part, size in _parts(generate):
        digest = hashlib.blake2b(previous + part, digest_size=HASH_BYTES).digest()
        previous = digest
        total += size
        hashes.append(digest.hex())
        chars.append(total)
        if len(hashes) == MAX_HASHES:
            break
    return PrefixChain(tuple(hashes), tuple(chars))


def _parts(generate: Generate) -> Iterator[tuple[bytes, int]]:
    """What is hashed, in order, and the prompt characters of each part."""
    head: dict[str, object] = {"model": generate.model}
    if generate.prompt is not None or generate.prompt_tokens is not None:
        head["raw"] = True
        yield orjson.dumps(head), 0
        if generate.prompt is not None:
            text = generate.prompt
            for start in range(0, len(text), RAW_BLOCK):
                block = text[start : start + RAW_BLOCK]
                yield block.encode(), len(block)
        else:
            ids = generate.prompt_tokens or ()
            for start in range(0, len(ids), RAW_TOKENS):
                block_ids = ids[start : start + RAW_TOKENS]
                # About 4 characters a token: what the gateway's estimate divides by.
                yield orjson.dumps(list(block_ids)), 4 * len(block_ids)
        return
    tools = () if generate.tool_choice == "none" else generate.tools
    head["tools"] = [attrs.astuple(tool) for tool in tools]
    head["template"] = generate.chat_template_kwargs
    head["thinking"] = generate.reasoning_effort not in ("none", "minimal")
    yield orjson.dumps(head), sum(len(t.description or "") + len(t.parameters or "") for t in tools)
    yield from _messages(generate.messages)


def _messages(messages: Iterable[Message]) -> Iterator[tuple[bytes, int]]:
    for message in messages:
        calls = [attrs.astuple(call) for call in message.tool_calls]
        parts: list[object] = [
            message.role,
            message.content,
            message.name,
            calls,
            message.tool_call_id,
        ]
        if message.reasoning is not None:  # the same hash as before for the rest
            parts.append(message.reasoning)
        chars = len(message.content) + len(message.reasoning or "")
        yield orjson.dumps(parts), chars + sum(len(call.arguments) for call in message.tool_calls)
