"""Reasoning split, stop strings and usage on scripted token sequences (no model)."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from protocol.frames import Usage
from runner.accounting import (
    Piece,
    ReasoningSplitter,
    RequestAccounting,
    StopMatcher,
    prompt_opens_reasoning,
)

START, END, EOS = 100, 101, 2
WORD = 7  # any ordinary token; the splitter only looks at marker ids


def split(splitter: ReasoningSplitter, tokens: list[tuple[int, str]]) -> tuple[str, str]:
    content, reasoning = [], []
    for token, text in tokens:
        c, r = splitter.feed(token, text)
        content.append(c)
        reasoning.append(r)
    return "".join(content), "".join(reasoning)


def test_prompt_opens_reasoning() -> None:
    assert prompt_opens_reasoning([1, 5, START, WORD], START, END)
    assert prompt_opens_reasoning([1, START], START, END)
    assert not prompt_opens_reasoning([1, START, WORD, END, WORD], START, END)
    assert not prompt_opens_reasoning([1, WORD], START, END)
    assert not prompt_opens_reasoning([], START, END)
    assert not prompt_opens_reasoning([1, START], None, None)


def test_span_is_reasoning_and_markers_count() -> None:
    splitter = ReasoningSplitter(START, END)
    tokens = [
        (WORD, "Hi"),
        (START, "<think>"),
        (WORD, "let me"),
        (WORD, " see"),
        (END, "</think>"),
        (WORD, "Yes"),
        (EOS, ""),
    ]
    assert split(splitter, tokens) == ("HiYes", "let me see")
    # <think>, two reasoning words, </think>
    assert splitter.reasoning_tokens == 4
    assert not splitter.in_reasoning


def test_generation_starting_inside_a_span() -> None:
    splitter = ReasoningSplitter(START, END, starts_in_reasoning=True)
    assert splitter.in_reasoning
    tokens = [(WORD, "hmm"), (WORD, " ok"), (END, "</think>"), (WORD, "Answer")]
    assert split(splitter, tokens) == ("Answer", "hmm ok")
    # The opening marker was in the prompt: two words and the closing marker.
    assert splitter.reasoning_tokens == 3


def test_unclosed_span_stays_reasoning() -> None:
    splitter = ReasoningSplitter(START, END)
    assert split(splitter, [(START, "<think>"), (WORD, "a"), (WORD, "b")]) == ("", "ab")
    assert splitter.reasoning_tokens == 3
    assert splitter.in_reasoning


def test_text_held_back_before_a_marker_goes_to_the_earlier_state() -> None:
    # Byte-level detokenizers hold a lone space until the next token, marker or not.
    splitter = ReasoningSplitter(START, END)
    tokens = [
        (WORD, "Hi"),
        (WORD, ""),
        (START, " <think>"),
        (WORD, "x"),
        (WORD, ""),
        (END, " </think>"),
        (WORD, "y"),
    ]
    assert split(splitter, tokens) == ("Hi y", "x ")


def test_markers_outside_their_role() -> None:
    splitter = ReasoningSplitter(START, END)
    # A stray </think> closes nothing: neither counted nor shown.
    assert split(splitter, [(WORD, "a"), (END, "</think>"), (WORD, "b")]) == ("ab", "")
    assert splitter.reasoning_tokens == 0
    # A second <think> inside a span is still a marker of the span.
    assert split(splitter, [(START, "<think>"), (START, "<think>"), (WORD, "r")]) == ("", "r")
    assert splitter.reasoning_tokens == 3


def test_without_marker_ids_everything_is_content() -> None:
    splitter = ReasoningSplitter(None, None, starts_in_reasoning=True)
    assert not splitter.in_reasoning
    assert split(splitter, [(START, "<think>"), (WORD, "a")]) == ("<think>a", "")
    assert splitter.reasoning_tokens == 0


def test_custom_marker_text() -> None:
    splitter = ReasoningSplitter(START, END, think_start_text="[T]", think_end_text="[/T]")
    assert split(splitter, [(START, "[T]"), (WORD, "r"), (END, "[/T]"), (WORD, "c")]) == (
        "c",
        "r",
    )


def feed_all(matcher: StopMatcher, parts: list[str]) -> list[str]:
    return [matcher.feed(part) for part in parts]


def test_stop_string_across_token_boundaries() -> None:
    matcher = StopMatcher(["STOP"])
    assert feed_all(matcher, ["abc S", "TO", "P def"]) == ["abc ", "", ""]
    assert matcher.stopped
    assert matcher.feed("more") == ""
    assert matcher.flush() == ""


def test_held_text_is_released_when_the_match_fails() -> None:
    matcher = StopMatcher(["xyz"])
    assert feed_all(matcher, ["ax", "y", "b"]) == ["a", "", "xyb"]
    assert not matcher.stopped


def test_held_text_is_flushed_at_the_end() -> None:
    matcher = StopMatcher(["xyz"])
    assert feed_all(matcher, ["ax", "y"]) == ["a", ""]
    assert matcher.flush() == "xy"
    assert matcher.flush() == ""


def test_earliest_stop_string_wins() -> None:
    matcher = StopMatcher(["world", "lo"])
    assert matcher.matched is None
    assert matcher.feed("hello world") == "hel"
    assert matcher.stopped
    assert matcher.matched == "lo"


def test_stop_inside_one_segment_and_at_the_start() -> None:
    assert StopMatcher(["\n"]).feed("line one\nline two") == "line one"
    matcher = StopMatcher(["END"])
    assert matcher.feed("END") == ""
    assert matcher.stopped


def test_no_stop_strings_pass_text_through() -> None:
    matcher = StopMatcher(["", ""])
    assert feed_all(matcher, ["a", "b"]) == ["a", "b"]
    assert matcher.flush() == ""


@given(
    text=st.text(alphabet="abc", max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=10),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_streamed_matching_equals_matching_the_whole_text(
    text: str, cuts: list[int], stops: list[str]
) -> None:
    bounds = sorted({0, len(text), *(min(cut, len(text)) for cut in cuts)})
    parts = [text[a:b] for a, b in itertools.pairwise(bounds)]
    matcher = StopMatcher(stops)
    emitted = "".join(matcher.feed(part) for part in parts) + matcher.flush()
    # The stop that completes first wins, as if the text came a character at a time.
    hits = [(i + len(stop), i, stop) for stop in stops if (i := text.find(stop)) >= 0]
    assert emitted == (text[: min(hits)[1]] if hits else text)
    assert matcher.stopped == bool(hits)
    assert matcher.matched == (min(hits)[2] if hits else None)


def test_the_stop_that_completes_first_wins_however_the_text_is_split() -> None:
    for parts in (["bc", "cac"], ["bcc", "ac"], ["b", "c", "c"]):
        matcher = StopMatcher(["bcc", "c"])
        emitted = "".join(matcher.feed(part) for part in parts) + matcher.flush()
        assert emitted == "b"


def test_usage_counts_every_token() -> None:
    accounting = RequestAccounting(
        prompt_tokens=12, cached_tokens=5, think_start_id=START, think_end_id=END
    )
    pieces = [
        accounting.feed(START, "<think>"),
        accounting.feed(WORD, "r"),
        accounting.feed(END, "</think>"),
        accounting.feed(WORD, "c"),
        accounting.feed(EOS, ""),
    ]
    assert [p.text for p in pieces] == ["", "", "", "c", ""]
    assert [p.reasoning for p in pieces] == ["", "r", "", "", ""]
    assert accounting.usage() == Usage(
        prompt_tokens=12, completion_tokens=5, cached_tokens=5, reasoning_tokens=3
    )


def test_stop_strings_apply_to_content_only() -> None:
    accounting = RequestAccounting(
        prompt_tokens=3, stop=["STOP"], think_start_id=START, think_end_id=END
    )
    assert accounting.feed(START, "<think>") == Piece("", "")
    assert accounting.feed(WORD, "no STOP here") == Piece("", "no STOP here")
    assert accounting.feed(END, "</think>") == Piece("", "")
    assert accounting.feed(WORD, "then ST") == Piece("then ", "")
    assert accounting.feed(WORD, "OP and more") == Piece("", "", stopped=True)
    assert accounting.stopped
    assert accounting.usage().completion_tokens == 5
    assert accounting.flush() == Piece("", "")


def test_stop_before_a_span_drops_the_reasoning_after_it() -> None:
    accounting = RequestAccounting(
        prompt_tokens=3, stop=["!"], think_start_id=START, think_end_id=END
    )
    assert accounting.feed(START, "Hi!<think>r") == Piece("Hi", "", stopped=True)


def test_flush_returns_held_content() -> None:
    accounting = RequestAccounting(prompt_tokens=1, stop=["xyz"])
    assert accounting.feed(WORD, "abx") == Piece("ab", "")
    assert accounting.flush() == Piece("x", "")
    assert accounting.usage() == Usage(prompt_tokens=1, completion_tokens=1)
