"""HarmonySplitter: gpt-oss's Harmony output split into content, reasoning and tool calls."""

from __future__ import annotations

import itertools
import re

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.frames import ToolCallDelta
from runner.harmony import (
    CALL,
    CHANNEL,
    CONSTRAIN,
    END,
    MARKERS,
    MESSAGE,
    RETURN,
    START,
    HarmonySplitter,
    harmony_markers,
)

# gpt-oss's ids (the o200k_harmony encoding); a text token is one character, id its code point.
IDS = {
    START: 200006,
    END: 200007,
    MESSAGE: 200008,
    CHANNEL: 200005,
    CONSTRAIN: 200003,
    RETURN: 200002,
    CALL: 200012,
}
_MARKER = re.compile("(" + "|".join(re.escape(marker) for marker in MARKERS) + ")")

Token = tuple[int, str]


def tokens(text: str, *, marker_text: bool = True) -> list[Token]:
    """`text` as tokens: each marker one special token (its text "" when `marker_text` is
    false, as from a detokenizer that skips specials), every other character one token."""
    out: list[Token] = []
    for piece in _MARKER.split(text):
        if piece in IDS:
            out.append((IDS[piece], piece if marker_text else ""))
        else:
            out.extend((ord(char), char) for char in piece)
    return out


@attrs.define
class Split:
    content: str
    reasoning: str
    deltas: list[ToolCallDelta]
    splitter: HarmonySplitter

    @property
    def calls(self) -> list[tuple[str, str]]:
        return calls(self.deltas)


def run(toks: list[Token], splitter: HarmonySplitter | None = None) -> Split:
    splitter = splitter or HarmonySplitter(IDS)
    content: list[str] = []
    reasoning: list[str] = []
    deltas: list[ToolCallDelta] = []
    for token_id, text in toks:
        more_content, more_reasoning, more = splitter.feed(token_id, text)
        content.append(more_content)
        reasoning.append(more_reasoning)
        deltas.extend(more)
    more_content, more_reasoning, more = splitter.flush()
    return Split(
        "".join(content) + more_content,
        "".join(reasoning) + more_reasoning,
        deltas + more,
        splitter,
    )


def calls(deltas: list[ToolCallDelta]) -> list[tuple[str, str]]:
    """(name, arguments text) per call, checking the delta rules on the way: a call's first
    delta has a fresh id, the name and no arguments; later ones only arguments; calls are
    numbered from 0 in order, each streamed before the next starts."""
    names: list[str] = []
    arguments: list[str] = []
    ids: set[str] = set()
    for delta in deltas:
        if delta.index == len(names):
            assert delta.id is not None
            assert delta.id.startswith("call_")
            assert delta.id not in ids
            ids.add(delta.id)
            assert delta.name is not None
            assert delta.arguments == ""
            names.append(delta.name)
            arguments.append("")
        else:
            assert delta.index == len(names) - 1
            assert (delta.id, delta.name) == (None, None)
            assert delta.arguments != ""
            arguments[delta.index] += delta.arguments
    return list(zip(names, arguments, strict=True))


ANALYSIS = "<|channel|>analysis<|message|>Let me think...<|end|>"
WEATHER = '{"city": "Paris", "days": 3, "t": 1.50e1}'


def test_analysis_then_final() -> None:
    out = run(
        tokens(ANALYSIS + "<|start|>assistant<|channel|>final<|message|>The answer.<|return|>")
    )
    assert (out.content, out.reasoning, out.deltas) == ("The answer.", "Let me think...", [])
    assert out.splitter.calls == 0
    assert out.splitter.stop == "return"
    # The whole analysis message: `<|channel|>`, 8 letters, `<|message|>`, 15 characters and
    # `<|end|>`.
    assert out.splitter.reasoning_tokens == len(tokens(ANALYSIS)) == 26


@pytest.mark.parametrize(
    "header",
    [
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json",
        "<|start|>assistant<|channel|>commentary to=functions.get_weather<|constrain|>json",
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json",
        "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json",
        "<|start|>assistant<|channel|>commentary to=functions.get_weather",
    ],
)
def test_analysis_then_a_tool_call(header: str) -> None:
    out = run(tokens(ANALYSIS + header + "<|message|>" + WEATHER + "<|call|>"))
    # The arguments are the text as written: the number 1.50e1 is not rewritten.
    assert out.calls == [("get_weather", WEATHER)]
    assert (out.content, out.reasoning) == ("", "Let me think...")
    assert out.splitter.calls == 1
    assert out.splitter.stop == "call"
    assert out.splitter.reasoning_tokens == 26


def test_the_first_delta_comes_with_the_header_and_arguments_stream() -> None:
    splitter = HarmonySplitter(IDS)
    header = tokens("<|channel|>commentary to=functions.f <|constrain|>json<|message|>")
    for token in header[:-1]:
        assert splitter.feed(*token) == ("", "", [])
    content, reasoning, [first] = splitter.feed(*header[-1])
    assert (content, reasoning, first.index, first.name, first.arguments) == ("", "", 0, "f", "")
    assert splitter.feed(1, '{"a": ') == ("", "", [ToolCallDelta(0, arguments='{"a": ')])
    assert splitter.feed(IDS[CALL], "") == ("", "", [])


def test_a_preamble_on_commentary_is_content() -> None:
    preamble = "**Action plan**:\n1. Generate an HTML file\n---\nWill start executing the plan"
    args = '{"template": "basic_html", "path": "index.html"}'
    out = run(
        tokens(
            "<|channel|>analysis<|message|>{long chain of thought}<|end|>"
            f"<|start|>assistant<|channel|>commentary<|message|>{preamble}<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.generate_file<|constrain|>json"
            f"<|message|>{args}<|call|>"
        )
    )
    assert (out.content, out.reasoning) == (preamble, "{long chain of thought}")
    assert out.calls == [("generate_file", args)]
    assert out.splitter.stop == "call"


@pytest.mark.parametrize("between", ["<|call|>", "<|end|>"])
def test_two_calls_in_one_answer(between: str) -> None:
    out = run(
        tokens(
            "<|channel|>analysis<|message|>Two lookups.<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
            f'<|message|>{{"city": "Paris"}}{between}'
            "<|start|>assistant<|channel|>analysis<|message|>And the time.<|end|>"
            "<|start|>assistant to=functions.get_time<|channel|>commentary json"
            '<|message|>{"tz": "CET"}<|call|>'
        )
    )
    assert out.calls == [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')]
    assert out.reasoning == "Two lookups.And the time."
    assert out.content == ""
    assert out.splitter.calls == 2
    assert out.splitter.stop == "call"
    assert out.splitter.reasoning_tokens == len(
        tokens(
            "<|channel|>analysis<|message|>Two lookups.<|end|>"
            "<|start|>assistant<|channel|>analysis<|message|>And the time.<|end|>"
        )
    )


def test_a_call_cut_off_mid_arguments_keeps_what_was_written() -> None:
    splitter = HarmonySplitter(IDS)
    out = run(
        tokens('<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Pa'),
        splitter,
    )
    assert out.calls == [("get_weather", '{"city": "Pa')]
    assert (out.content, out.reasoning) == ("", "")
    assert splitter.calls == 1
    assert splitter.stop is None
    assert splitter.flush() == ("", "", [])


def test_a_call_cut_off_in_its_header_is_no_call() -> None:
    out = run(tokens(ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.get_wea"))
    assert (out.content, out.reasoning, out.deltas) == ("", "Let me think...", [])
    assert out.splitter.calls == 0
    assert out.splitter.stop is None
    # The cut-off message has no body: its tokens count nowhere.
    assert out.splitter.reasoning_tokens == 26


def test_final_cut_off_streams_what_came() -> None:
    out = run(tokens(ANALYSIS + "<|start|>assistant<|channel|>final<|message|>The ans"))
    assert (out.content, out.reasoning, out.splitter.stop) == ("The ans", "Let me think...", None)


def test_garbage_between_messages_reaches_no_stream() -> None:
    out = run(
        tokens(
            "<|channel|>analysis<|message|>A<|end|>"
            " junk assistant final<|message|>more junk<|constrain|>json<|end|>\n<b>x</b>"
            "<|start|>assistant<|channel|>final<|message|>B<|return|> trailing junk<|end|>"
        )
    )
    assert (out.content, out.reasoning, out.deltas) == ("B", "A", [])
    assert out.splitter.stop == "return"
    assert out.splitter.reasoning_tokens == len(tokens("<|channel|>analysis<|message|>A<|end|>"))


def test_a_channel_between_messages_opens_one() -> None:
    # The model left out `<|start|>assistant`: the message starts at its `<|channel|>`.
    out = run(
        tokens(
            "<|channel|>analysis<|message|>A<|end|>junk"
            "<|channel|>analysis<|message|>B<|end|>"
            "<|channel|>final<|message|>C<|return|>"
        )
    )
    assert (out.content, out.reasoning) == ("C", "AB")
    assert out.splitter.reasoning_tokens == 2 * len(
        tokens("<|channel|>analysis<|message|>A<|end|>")
    )


def test_junk_between_messages_without_markers_is_dropped() -> None:
    out = run(
        tokens(
            "<|channel|>final<|message|>Hi<|end|>free text <b>x</b><|message|>still junk<|end|>"
            "<|start|>assistant<|channel|>final<|message|> there<|return|>"
        )
    )
    assert (out.content, out.reasoning) == ("Hi there", "")


def test_stray_markers_in_a_body_are_dropped() -> None:
    out = run(
        tokens(
            "<|channel|>analysis<|message|>a<|channel|>b<|constrain|>c<|message|>d<|end|>"
            "<|start|>assistant<|channel|>final<|message|>e<|constrain|>f<|channel|>g<|return|>"
        )
    )
    assert (out.content, out.reasoning) == ("efg", "abcd")
    # Stray markers are tokens of their message.
    assert out.splitter.reasoning_tokens == len(
        tokens("<|channel|>analysis<|message|>a<|channel|>b<|constrain|>c<|message|>d<|end|>")
    )


def test_a_start_inside_a_body_ends_that_message() -> None:
    out = run(
        tokens(
            "<|channel|>analysis<|message|>Say hi."
            "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>"
        )
    )
    assert (out.content, out.reasoning) == ("Hello!", "Say hi.")
    assert out.splitter.reasoning_tokens == len(tokens("<|channel|>analysis<|message|>Say hi."))


def test_a_header_ended_before_its_body_is_dropped() -> None:
    out = run(
        tokens(
            "<|channel|>analysis<|end|><|start|>assistant<|start|>assistant"
            "<|channel|>final<|message|>ok<|return|>"
        )
    )
    assert (out.content, out.reasoning, out.splitter.reasoning_tokens) == ("ok", "", 0)


def test_a_message_the_model_writes_as_another_role_is_dropped() -> None:
    out = run(
        tokens(
            "<|channel|>commentary to=functions.get_weather json<|message|>{}<|call|>"
            "<|start|>functions.get_weather to=assistant<|channel|>commentary"
            '<|message|>{"sunny": true}<|end|>'
            "<|start|>user<|message|>thanks<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"
        )
    )
    assert (out.content, out.reasoning) == ("Sunny.", "")
    assert out.calls == [("get_weather", "{}")]
    assert out.splitter.stop == "return"


@pytest.mark.parametrize(
    "header",
    [
        "<|channel|>analysis to=browser.search json",
        "<|channel|>analysis to=python code",
        "<|channel|>commentary to=browser.open <|constrain|>json",
        "<|channel|>commentary to=functions.",
    ],
)
def test_a_call_to_a_builtin_tool_is_reasoning(header: str) -> None:
    out = run(tokens(f'{header}<|message|>{{"query": "x"}}<|call|>'))
    assert (out.content, out.reasoning, out.deltas) == ("", '{"query": "x"}', [])
    assert out.splitter.calls == 0
    assert out.splitter.stop == "call"
    # The whole message counts, its closing `<|call|>` too.
    assert out.splitter.reasoning_tokens == len(
        tokens(f'{header}<|message|>{{"query": "x"}}<|call|>')
    )


@pytest.mark.parametrize(
    ("header", "content", "reasoning"),
    [
        ("<|channel|>final", "x", ""),
        ("<|channel|>commentary", "x", ""),
        ("<|channel|>analysis", "", "x"),
        ("<|channel|>thoughts", "", "x"),
        ("", "", "x"),
        ("<|channel|>final json", "x", ""),
        ("assistant<|channel|>final", "x", ""),
    ],
)
def test_channels(header: str, content: str, reasoning: str) -> None:
    out = run(tokens(f"{header}<|message|>x<|end|>"))
    assert (out.content, out.reasoning) == (content, reasoning)


def test_markers_with_empty_text_split_the_same() -> None:
    text = (
        ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        f"<|message|>{WEATHER}<|call|>"
    )
    with_text, without = run(tokens(text)), run(tokens(text, marker_text=False))
    for out in (with_text, without):
        assert (out.content, out.reasoning) == ("Checking.", "Let me think...")
        assert out.calls == [("get_weather", WEATHER)]
        assert out.splitter.stop == "call"
    assert with_text.splitter.reasoning_tokens == without.splitter.reasoning_tokens == 26


@pytest.mark.parametrize("marker_text", [True, False])
def test_text_held_back_into_a_marker_segment_belongs_before_it(marker_text: bool) -> None:
    """mlx-lm's BPE detokenizer holds a lone space until the next token: the space then
    comes in the marker's segment, ahead of the marker's text."""

    def seg(marker: str) -> str:
        return marker if marker_text else ""

    splitter = HarmonySplitter(IDS)
    toks: list[Token] = [
        *tokens("<|channel|>analysis<|message|>think"),
        (IDS[END], " " + seg(END)),
        *tokens("<|start|>assistant<|channel|>commentary to=functions.f"),
        (IDS[CONSTRAIN], " " + seg(CONSTRAIN)),
        *tokens("json<|message|>{}"),
        (IDS[END], "\n" + seg(END)),
        *tokens("<|start|>assistant<|channel|>final<|message|>Done."),
        (IDS[RETURN], " "),
    ]
    out = run(toks, splitter)
    assert (out.content, out.reasoning) == ("Done. ", "think ")
    assert out.calls == [("f", "{}\n")]


def test_text_spelling_a_marker_is_text() -> None:
    # The model writes "<|end|>" with ordinary tokens: not a marker, so part of the answer.
    literal = [(ord(char), char) for char in "<|end|> and <|start|>"]
    out = run([*tokens("<|channel|>final<|message|>"), *literal, *tokens("<|return|>")])
    assert out.content == "<|end|> and <|start|>"


def test_markers() -> None:
    vocab = {**IDS, "hello": 1}
    assert harmony_markers(vocab) == IDS
    assert harmony_markers({"hello": 1, START: 2}) is None
    with pytest.raises(ValueError, match=r"<\|call\|>"):
        HarmonySplitter({marker: IDS[marker] for marker in MARKERS if marker != CALL})
    with pytest.raises(ValueError, match="distinct"):
        HarmonySplitter({**IDS, CALL: IDS[END]})


# Property: a generated answer, rendered to tokens and fed a piece at a time, splits as built.

_TEXT = st.lists(
    st.sampled_from([*'ab xyz{}":,.<|>\n', " ", "é", "🙂", "<|end|>", "<|channel|>"]), max_size=12
).map("".join)
"""Body text, marker spellings included (ordinary tokens there)."""
_NAME = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)


@attrs.frozen
class Message:
    kind: str
    """analysis, final, preamble, call, builtin"""
    body: str
    name: str = ""


@st.composite
def messages(draw: st.DrawFn) -> Message:
    kind = draw(st.sampled_from(["analysis", "final", "preamble", "call", "builtin"]))
    name = draw(_NAME) if kind == "call" else ""
    if kind == "builtin":
        name = draw(st.sampled_from(["browser.search", "python", "browser.open"]))
    return Message(kind, draw(_TEXT), name)


@st.composite
def header(draw: st.DrawFn, message: Message) -> str:
    """The header after `<|start|>`, in one of the ways the model writes it."""
    if message.kind in ("analysis", "final"):
        return f"assistant<|channel|>{message.kind}"
    if message.kind == "preamble":
        return "assistant<|channel|>commentary"
    recipient = f"functions.{message.name}" if message.kind == "call" else message.name
    channel = "commentary"
    if message.kind == "builtin":
        channel = draw(st.sampled_from(["analysis", "commentary"]))
    kind = draw(st.sampled_from(["", " json", " <|constrain|>json", "<|constrain|>json"]))
    if draw(st.booleans()):
        return f"assistant to={recipient}<|channel|>{channel}{kind}"
    return f"assistant<|channel|>{channel} to={recipient}{kind}"


@attrs.define
class Piece:
    token_id: int
    text: str
    """The token's own text ("" for a marker whose text the detokenizer skips)."""
    message: int | None
    """Which message the token belongs to (None: junk between messages)."""
    part: str
    """header, open (its `<|message|>`), body, close or junk."""
    held: str = ""
    """Text of the previous token that the detokenizer held back and sent with this one."""


def is_marker(piece: Piece) -> bool:
    return piece.token_id in IDS.values()


@st.composite
def chunked(
    draw: st.DrawFn, text: str, message: int | None, part: str, *, markers: bool = True
) -> list[Piece]:
    """`text` as tokens: each marker one (with `markers`), other text in random chunks (id 1)."""
    pieces: list[Piece] = []
    for segment in _MARKER.split(text) if markers else [text]:
        if segment in IDS and markers:
            pieces.append(Piece(IDS[segment], segment, message, part))
            continue
        cuts = draw(st.sets(st.integers(1, max(1, len(segment) - 1)), max_size=4))
        bounds = sorted({0, len(segment), *(cut for cut in cuts if cut < len(segment))})
        pieces.extend(
            Piece(1, segment[start:end], message, part) for start, end in itertools.pairwise(bounds)
        )
    return pieces


@attrs.frozen
class Case:
    pieces: list[Piece]
    answer: list[Message]


@st.composite
def answers(draw: st.DrawFn) -> Case:
    answer = draw(st.lists(messages(), min_size=1, max_size=5))
    pieces: list[Piece] = []
    for number, message in enumerate(answer):
        head = draw(header(message))
        if number == 0:
            # The prompt's `<|start|>assistant` opened the first message.
            head = head.removeprefix("assistant")
        else:
            junk = draw(st.sampled_from(["", " ", "\njunk <b> "]))
            pieces.extend(draw(chunked(junk, None, "junk", markers=False)))
            pieces.append(Piece(IDS[START], START, number, "header"))
        pieces.extend(draw(chunked(head, number, "header")))
        pieces.append(Piece(IDS[MESSAGE], MESSAGE, number, "open"))
        pieces.extend(draw(chunked(message.body, number, "body", markers=False)))
        if number < len(answer) - 1:
            close = CALL if message.kind in ("call", "builtin") and draw(st.booleans()) else END
        else:
            close = {"final": RETURN, "call": CALL, "builtin": CALL}.get(message.kind, END)
        pieces.append(Piece(IDS[close], close, number, "close"))
    # Not cut off, or cut off anywhere.
    pieces = pieces[: draw(st.just(len(pieces)) | st.integers(1, len(pieces)))]
    for index, piece in enumerate(pieces):
        if not is_marker(piece):
            continue
        if draw(st.booleans()):
            piece.text = ""  # a detokenizer that skips special tokens
        before = pieces[index - 1] if index else None
        if before and not is_marker(before) and before.text.endswith(" ") and draw(st.booleans()):
            # mlx-lm's BPE detokenizer holds a lone space back until the next token.
            before.text = before.text[:-1]
            piece.held = " "
    return Case(pieces, answer)


def expected(case: Case) -> tuple[str, str, list[tuple[str, str]], int, str | None]:
    """What the split must give: content, reasoning, calls, reasoning tokens, stop."""
    opened = {piece.message for piece in case.pieces if piece.part == "open"}
    content: list[str] = []
    reasoning: list[str] = []
    call_list: list[tuple[str, str]] = []
    reasoning_tokens = 0
    stop: str | None = None

    def route(owner: Piece, text: str) -> None:
        if owner.part != "body" or owner.message is None or owner.message not in opened:
            return
        if not text:
            return
        message = case.answer[owner.message]
        if message.kind in ("final", "preamble"):
            content.append(text)
        elif message.kind in ("analysis", "builtin"):
            reasoning.append(text)
        else:
            name, arguments = call_list[-1]
            call_list[-1] = (name, arguments + text)

    for index, piece in enumerate(case.pieces):
        route(case.pieces[index - 1], piece.held)
        if piece.token_id == IDS[START]:
            stop = None
        elif piece.token_id in (IDS[CALL], IDS[RETURN]):
            stop = "call" if piece.token_id == IDS[CALL] else "return"
        if piece.message not in opened:
            continue
        assert piece.message is not None
        message = case.answer[piece.message]
        if message.kind in ("analysis", "builtin"):
            reasoning_tokens += 1
        if piece.part == "open" and message.kind == "call":
            call_list.append((message.name, ""))
        route(piece, piece.text)
    return "".join(content), "".join(reasoning), call_list, reasoning_tokens, stop


@settings(max_examples=200)
@given(answers())
def test_a_generated_answer_splits_as_it_was_built(case: Case) -> None:
    out = run([(piece.token_id, piece.held + piece.text) for piece in case.pieces])
    content, reasoning, call_list, reasoning_tokens, stop = expected(case)
    assert out.content == content
    assert out.reasoning == reasoning
    assert out.calls == call_list
    assert out.splitter.calls == len(call_list)
    assert out.splitter.reasoning_tokens == reasoning_tokens
    assert out.splitter.stop == stop
