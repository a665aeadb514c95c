"""`SamplingParams.unset`: every dialect's parser names exactly the defaultable sampling
parameters (temperature, top_p, top_k, min_p) its client left out, so that a runner's
defaults replace those and only those."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from protocol.anthropic.request import parse_messages_request
from protocol.browser.messages import chat_request
from protocol.frames import DEFAULTABLE, SamplingParams, unset_of
from protocol.ollama.request import OLLAMA_DEFAULTS, parse_chat, parse_generate
from protocol.openai.chat.request import parse_chat_request
from protocol.openai.completions.request import parse_completion_request
from protocol.openai.responses.request import parse_compact_request, parse_responses_request

USER = {"role": "user", "content": "hi"}


def _body(obj: dict[str, Any]) -> bytes:
    return orjson.dumps(obj)


def test_unset_of_names_the_missing_and_the_null_in_a_fixed_order() -> None:
    assert DEFAULTABLE == ("temperature", "top_p", "top_k", "min_p")
    assert unset_of() == ("temperature", "top_p", "top_k", "min_p")
    assert unset_of(min_p=0.1, temperature=None, top_k=0) == ("temperature", "top_p")
    assert unset_of(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0) == ()


def test_unset_of_refuses_a_name_it_does_not_know() -> None:
    with pytest.raises(TypeError, match="not a defaultable sampling parameter: seed"):
        unset_of(seed=3)


# Each dialect: (a body with none of its sampling parameters, what its parser leaves unset;
# the same body with all it takes set).
CHAT = {"model": "m", "messages": [USER]}
COMPLETION = {"model": "m", "prompt": "hi"}
RESPONSES = {"model": "m", "input": "hi"}
ANTHROPIC = {"model": "m", "max_tokens": 8, "messages": [USER]}
OLLAMA_CHAT = {"model": "m", "messages": [USER]}
OLLAMA_GENERATE = {"model": "m", "prompt": "hi"}
ALL_OPENAI = {"temperature": 0.5, "top_p": 0.5, "top_k": 3, "min_p": 0.1}


@pytest.mark.parametrize(
    ("parse", "body"),
    [
        (lambda b: parse_chat_request(b).sampling, CHAT),
        (lambda b: parse_completion_request(b).sampling, COMPLETION),
    ],
    ids=["chat", "completions"],
)
def test_openai_chat_and_completions(parse: Any, body: dict[str, Any]) -> None:
    assert parse(_body(body)) == SamplingParams(unset=DEFAULTABLE)
    assert parse(_body({**body, **ALL_OPENAI})) == SamplingParams(0.5, 0.5, 3, 0.1)
    # Explicit values equal to the defaults, and top_k -1 ("off"), are set all the same.
    explicit = {"temperature": 1, "top_p": 1, "top_k": -1, "min_p": 0}
    assert parse(_body({**body, **explicit})).unset == ()
    # null is as good as leaving it out.
    assert parse(_body({**body, "temperature": None, "top_k": 5})) == SamplingParams(
        top_k=5, unset=("temperature", "top_p", "min_p")
    )


def test_the_browser_sockets_chat_request() -> None:
    chat = chat_request({**CHAT, "top_p": 0.25}, max_tokens_limit=100)
    assert chat.sampling == SamplingParams(top_p=0.25, unset=("temperature", "top_k", "min_p"))
    assert chat.to_generate("r").sampling.unset == ("temperature", "top_k", "min_p")


def test_responses_has_no_top_k_or_min_p_so_they_are_always_unset() -> None:
    sampling = parse_responses_request(_body(RESPONSES)).sampling
    assert sampling == SamplingParams(unset=DEFAULTABLE)
    both = parse_responses_request(_body({**RESPONSES, "temperature": 0, "top_p": 0.5}))
    assert both.sampling == SamplingParams(temperature=0.0, top_p=0.5, unset=("top_k", "min_p"))
    # Compacting takes no sampling parameter: it runs at the model's defaults.
    compact = parse_compact_request(_body({"model": "m", "input": "hi"}))
    assert compact.sampling == SamplingParams(unset=DEFAULTABLE)


def test_anthropic_has_no_min_p_so_it_is_always_unset() -> None:
    assert parse_messages_request(_body(ANTHROPIC)).sampling == SamplingParams(unset=DEFAULTABLE)
    given = {**ANTHROPIC, "temperature": 0, "top_p": 0.5, "top_k": 0}
    assert parse_messages_request(_body(given)).sampling == SamplingParams(
        temperature=0.0, top_p=0.5, top_k=0, unset=("min_p",)
    )


@pytest.mark.parametrize(
    ("parse", "body"), [(parse_chat, OLLAMA_CHAT), (parse_generate, OLLAMA_GENERATE)]
)
def test_ollama_lists_its_own_defaults_as_unset(parse: Any, body: dict[str, Any]) -> None:
    # Without options, and with options that set none of them: Ollama's 0.8, 0.9, 40, all unset.
    assert OLLAMA_DEFAULTS.unset == DEFAULTABLE
    assert parse(_body(body)).sampling == OLLAMA_DEFAULTS
    seeded = parse(_body({**body, "options": {"seed": 4}})).sampling
    assert seeded == SamplingParams(0.8, 0.9, 40, seed=4, unset=DEFAULTABLE)
    some = parse(_body({**body, "options": {"temperature": 0, "min_p": 0.05}})).sampling
    assert some == SamplingParams(0.0, 0.9, 40, 0.05, unset=("top_p", "top_k"))
    every = {"temperature": 0.5, "top_p": 0.5, "top_k": 0, "min_p": 0.0}
    assert parse(_body({**body, "options": every})).sampling == SamplingParams(0.5, 0.5, 0, 0.0)
