"""The prefix hashes of requests (protocol.prefix): equal exactly where the prompts' leading
parts are, for every kind of request the dialects make."""

from __future__ import annotations

import attrs

from protocol.frames import Generate, Message, Tool, ToolCall
from protocol.prefix import MAX_HASHES, RAW_BLOCK, RAW_TOKENS, prefix_chain

SYSTEM = Message("system", "You are terse. " * 20)


def chat(*messages: Message, **fields: object) -> Generate:
    return Generate("r", "m", messages, **fields)  # type: ignore[arg-type]


def test_a_chat_hashes_its_head_then_each_message() -> None:
    turn1 = chat(SYSTEM, Message("user", "Hi"))
    turn2 = chat(SYSTEM, Message("user", "Hi"), Message("assistant", "Hello"), Message("user", "?"))
    one, two = prefix_chain(turn1), prefix_chain(turn2)
    assert len(one.hashes) == 3  # the head, then two messages
    assert len(two.hashes) == 5
    assert two.hashes[:3] == one.hashes  # turn 2 starts with turn 1
    assert len(set(two.hashes)) == 5
    assert all(len(h) == 16 and int(h, 16) >= 0 for h in two.hashes)
    # The characters each covers: none for a head without tools, then each message's text.
    assert one.chars == (0, len(SYSTEM.content), len(SYSTEM.content) + 2)
    assert two.total_chars == len(SYSTEM.content) + 2 + 5 + 1


def test_the_same_request_hashes_the_same_and_ids_do_not_matter() -> None:
    a = chat(SYSTEM, Message("user", "Hi"))
    assert prefix_chain(a) == prefix_chain(attrs.evolve(a, request_id="other", max_tokens=9))


def test_what_changes_the_prompt_from_its_start_changes_every_hash() -> None:
    base = chat(SYSTEM, Message("user", "Hi"))
    tool = Tool("weather", "Get the weather", '{"type": "object"}')
    variants = [
        attrs.evolve(base, model="other"),
        attrs.evolve(base, tools=(tool,)),
        attrs.evolve(base, chat_template_kwargs='{"x": 1}'),
        attrs.evolve(base, reasoning_effort="none"),
    ]
    for variant in variants:
        assert not set(prefix_chain(variant).hashes) & set(prefix_chain(base).hashes), variant
    # Tools the model is not shown (tool_choice "none") do not change the prompt.
    hidden = attrs.evolve(base, tools=(tool,), tool_choice="none")
    assert prefix_chain(hidden) == prefix_chain(base)
    # A tool's schema counts in the characters the head covers.
    assert prefix_chain(variants[1]).chars[0] == len("Get the weather") + len('{"type": "object"}')


def test_a_message_that_differs_anywhere_ends_the_shared_part() -> None:
    a = chat(SYSTEM, Message("user", "Hi"), Message("assistant", "Yes", tool_calls=()))
    calls = (ToolCall("c1", "weather", '{"city": "Paris"}'),)
    variants = [
        chat(SYSTEM, Message("user", "Hi!"), Message("assistant", "Yes")),
        chat(SYSTEM, Message("user", "Hi", name="bob"), Message("assistant", "Yes")),
        chat(SYSTEM, Message("user", "Hi"), Message("assistant", "Yes", tool_calls=calls)),
        chat(SYSTEM, Message("developer", "Hi"), Message("assistant", "Yes")),
    ]
    for variant, differs_from in zip(variants, (2, 2, 3, 2), strict=True):
        ours, theirs = prefix_chain(a).hashes, prefix_chain(variant).hashes
        assert ours[:differs_from] == theirs[:differs_from]
        assert ours[differs_from:] != theirs[differs_from:]
        assert not set(ours[differs_from:]) & set(theirs[differs_from:])
    answer = chat(SYSTEM, Message("tool", "18 C", tool_call_id="c1"))
    other = chat(SYSTEM, Message("tool", "18 C", tool_call_id="c2"))
    assert prefix_chain(answer).hashes[-1] != prefix_chain(other).hashes[-1]


def test_reasoning_given_back_is_part_of_its_message() -> None:
    calls = (ToolCall("c1", "weather", "{}"),)
    bare = chat(SYSTEM, Message("user", "Hi"), Message("assistant", "", tool_calls=calls))
    why = attrs.evolve(
        bare, messages=(*bare.messages[:2], attrs.evolve(bare.messages[2], reasoning="Why"))
    )
    ours, theirs = prefix_chain(bare), prefix_chain(why)
    assert ours.hashes[:3] == theirs.hashes[:3]
    assert ours.hashes[3] != theirs.hashes[3]
    assert theirs.chars[3] - theirs.chars[2] == len("Why") + len("{}")
    # Empty reasoning is still reasoning given (a template may render an empty analysis).
    empty = attrs.evolve(
        why, messages=(*why.messages[:2], attrs.evolve(why.messages[2], reasoning=""))
    )
    assert prefix_chain(empty).hashes[3] not in (ours.hashes[3], theirs.hashes[3])


def test_a_raw_prompt_hashes_in_blocks_and_never_as_a_chat() -> None:
    text = "x" * (2 * RAW_BLOCK + 5)
    raw = Generate("r", "m", (), prompt=text)
    chain = prefix_chain(raw)
    assert chain.chars == (0, RAW_BLOCK, 2 * RAW_BLOCK, 2 * RAW_BLOCK + 5)
    longer = Generate("r", "m", (), prompt=text + "y" * 10)
    assert prefix_chain(longer).hashes[:3] == chain.hashes[:3]
    assert prefix_chain(longer).hashes[3] != chain.hashes[3]
    as_chat = chat(Message("user", text))
    assert not set(prefix_chain(as_chat).hashes) & set(chain.hashes)
    ids = Generate("r", "m", (), prompt_tokens=tuple(range(RAW_TOKENS + 1)))
    assert prefix_chain(ids).chars == (0, 4 * RAW_TOKENS, 4 * (RAW_TOKENS + 1))


def test_a_long_conversation_is_cut_at_the_bound() -> None:
    messages = [Message("user", f"turn {i}") for i in range(MAX_HASHES + 50)]
    assert len(prefix_chain(chat(*messages)).hashes) == MAX_HASHES
