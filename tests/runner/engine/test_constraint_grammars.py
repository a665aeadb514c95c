"""Constrained decoding (runner.engine.constraint) on the demo model's real tokenizer: the
grammars a request asks for (a response format, forced tool calls), what cannot be enforced,
and the cache of compiled grammars."""

from __future__ import annotations

import json
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tool_parsers import json_tools, longcat

from protocol.frames import ResponseFormat, Tool
from runner.engine import constraint as constraint_module
from runner.engine.constraint import Constraint, constraint_for
from runner.errors import RequestError
from tests.runner.engine.constraint_cases import (
    NOW,
    SMALL,
    WEATHER,
    allowed,
    compile_for,
    schema_format,
)
from tests.runner.engines import Reference, ask


def call(name: str, arguments: dict[str, Any]) -> str:
    """One call in the json_tools (Hermes, Qwen) format."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def tokenizer(reference: Reference) -> Any:
    """The demo model's mlx-lm tokenizer."""
    return reference.tokenizer


@pytest.fixture(scope="module")
def tools_tokenizer(tokenizer: Any) -> Any:
    """The demo tokenizer with mlx-lm's json_tools tool-call format (v2 has it already)."""
    if getattr(tokenizer.tool_parser, "__module__", None) == json_tools.__name__:
        return tokenizer
    return TokenizerWrapper(
        tokenizer._tokenizer,
        eos_token_ids=tokenizer.eos_token_ids,
        tool_call_start=json_tools.tool_call_start,
        tool_call_end=json_tools.tool_call_end,
        tool_parser=json_tools.parse_tool_call,
    )


def accepts(constraint: Constraint, tokenizer: Any, text: str) -> bool:
    """Whether the processor lets a model write `text` (tokenized as the tokenizer does), then
    end."""
    processor = constraint.processor()
    vocab = len(tokenizer)
    context = [7, 8, 9]  # a prompt
    for token in tokenizer.encode(text, add_special_tokens=False):
        if token not in allowed(processor, context, vocab):
            return False
        context.append(token)
    return bool(allowed(processor, context, vocab) & set(tokenizer.eos_token_ids))


# The grammars.


def test_free_text_has_no_constraint(tokenizer: Any) -> None:
    assert constraint_for(ask("r"), tokenizer) is None
    assert constraint_for(ask("r", response_format=ResponseFormat("text")), tokenizer) is None
    for choice in ("auto", "none"):
        assert constraint_for(ask("r", tools=(WEATHER,), tool_choice=choice), tokenizer) is None
    # Without tools, tool_choice means nothing (the gateway refuses it; here it is ignored).
    assert constraint_for(ask("r", tool_choice="required"), tokenizer) is None


def test_json_object_is_any_object_written_compactly(tokenizer: Any) -> None:
    constraint = compile_for(tokenizer, response_format=ResponseFormat("json_object"))
    assert accepts(constraint, tokenizer, '{"a": [1, "x", {"b": null}], "c": true}')
    assert accepts(constraint, tokenizer, "{}")
    for wrong in ("[1, 2]", '"text"', '{"a":1}', '{ "a": 1}', '{"a": 1}\n', '{"a": 1'):
        assert not accepts(constraint, tokenizer, wrong), wrong


def test_json_schema_is_enforced(tokenizer: Any) -> None:
    constraint = compile_for(tokenizer, response_format=schema_format(SMALL))
    assert accepts(constraint, tokenizer, '{"ok": true, "n": 42, "color": "red"}')
    for wrong in (
        '{"ok": true, "n": 100, "color": "red"}',
        '{"ok": true, "n": 4, "color": "pink"}',
        '{"ok": true, "n": 4}',
        '{"ok": 1, "n": 4, "color": "red"}',
        '{"ok": true, "n": 4, "color": "red", "x": 1}',
    ):
        assert not accepts(constraint, tokenizer, wrong), wrong


def test_schemas_with_references_and_recursion(tokenizer: Any) -> None:
    schema = {
        "type": "object",
        "properties": {"root": {"$ref": "#/$defs/node"}},
        "required": ["root"],
        "additionalProperties": False,
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["v", "kids"],
                "additionalProperties": False,
            }
        },
    }
    constraint = compile_for(tokenizer, response_format=schema_format(schema))
    tree = {"root": {"v": 1, "kids": [{"v": None, "kids": [{"v": 3, "kids": []}]}]}}
    assert accepts(constraint, tokenizer, json.dumps(tree))
    assert not accepts(constraint, tokenizer, json.dumps({"root": {"v": 1, "kids": [1]}}))


def test_tool_choice_function_is_one_call_of_that_function(tools_tokenizer: Any) -> None:
    constraint = compile_for(
        tools_tokenizer, tools=(NOW, WEATHER), tool_choice="function", tool_name="weather"
    )
    one = call("weather", {"city": "Oslo", "days": 3})
    assert accepts(constraint, tools_tokenizer, one)
    assert not accepts(constraint, tools_tokenizer, call("now", {}))
    assert not accepts(constraint, tools_tokenizer, call("weather", {"city": "Oslo"}))
    assert not accepts(constraint, tools_tokenizer, f"{one}\n{one}")
    assert not accepts(constraint, tools_tokenizer, "It is sunny.")


def test_tool_choice_required_is_calls_of_any_tool_each_with_its_schema(
    tools_tokenizer: Any,
) -> None:
    constraint = compile_for(tools_tokenizer, tools=(NOW, WEATHER), tool_choice="required")
    weather, now = call("weather", {"city": "Oslo", "days": 3}), call("now", {})
    assert accepts(constraint, tools_tokenizer, now)
    assert accepts(constraint, tools_tokenizer, f"{weather}\n{now}\n{weather}")
    assert not accepts(constraint, tools_tokenizer, call("now", {"city": "Oslo"}))
    assert not accepts(constraint, tools_tokenizer, call("sleep", {}))
    assert not accepts(constraint, tools_tokenizer, "")
    single = compile_for(
        tools_tokenizer, tools=(NOW, WEATHER), tool_choice="required", parallel_tool_calls=False
    )
    assert accepts(single, tools_tokenizer, weather)
    assert not accepts(single, tools_tokenizer, f"{weather}\n{now}")


def test_tools_win_over_the_response_format_unless_the_choice_is_auto(
    tools_tokenizer: Any,
) -> None:
    weather, body = (
        call("weather", {"city": "Oslo", "days": 3}),
        '{"ok": false, "n": 0, "color": "blue"}',
    )
    fmt = schema_format(SMALL)
    forced = compile_for(
        tools_tokenizer, tools=(WEATHER,), tool_choice="required", response_format=fmt
    )
    assert accepts(forced, tools_tokenizer, weather)
    assert not accepts(forced, tools_tokenizer, body)
    either = compile_for(tools_tokenizer, tools=(WEATHER,), response_format=fmt)
    assert accepts(either, tools_tokenizer, weather)
    assert accepts(either, tools_tokenizer, body)
    # "none": the model is not told about tools; only the format.
    neither = compile_for(
        tools_tokenizer, tools=(WEATHER,), tool_choice="none", response_format=fmt
    )
    assert not accepts(neither, tools_tokenizer, weather)
    assert accepts(neither, tools_tokenizer, body)


def test_forced_calls_need_a_format_with_a_grammar(tokenizer: Any, tools_tokenizer: Any) -> None:
    # LongCat's format is read whole by mlx-lm's parser, and has no grammar here.
    longcat_tokenizer = TokenizerWrapper(
        tools_tokenizer._tokenizer,
        eos_token_ids=tools_tokenizer.eos_token_ids,
        tool_call_start=longcat.tool_call_start,
        tool_call_end=longcat.tool_call_end,
        tool_parser=longcat.parse_tool_call,
    )
    for choice in ("required", "function"):
        request = ask("r", tools=(WEATHER,), tool_choice=choice, tool_name="weather")
        with pytest.raises(RequestError) as raised:
            constraint_for(request, longcat_tokenizer)
        assert raised.value.code == "invalid_request"
        assert raised.value.param == "tool_choice"
        assert str(raised.value) == (
            f'tool_choice "{choice}" is not supported for this model\'s tool-call format '
            "(longcat): calls can be enforced in these formats: json_tools, qwen3_coder, "
            "minimax_m2, glm47, kimi_k2, mistral, pythonic, gemma4."
        )
    request = ask("r", tools=(WEATHER,), response_format=ResponseFormat("json_object"))
    with pytest.raises(RequestError, match="A JSON response_format with tools is not supported"):
        constraint_for(request, longcat_tokenizer)


def test_what_cannot_be_enforced_is_named_with_its_place(tools_tokenizer: Any) -> None:
    def refusal(**fields: Any) -> RequestError:
        with pytest.raises(RequestError) as raised:
            constraint_for(ask("r", **fields), tools_tokenizer)
        assert raised.value.code == "invalid_request"
        return raised.value

    error = refusal(response_format=schema_format({"type": "object", "not": {"required": ["a"]}}))
    assert str(error) == (
        "response_format.json_schema.schema: this schema cannot be enforced: Unimplemented keys: "
        '["not"]'
    )
    assert error.param == "response_format"
    unique = json.dumps({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    bad_tool = Tool(
        "ids", parameters=json.dumps({"type": "object", "properties": {"x": json.loads(unique)}})
    )
    error = refusal(tools=(WEATHER, bad_tool), tool_choice="required")
    assert str(error).startswith("tools[1].function.parameters: this schema cannot be enforced:")
    assert "uniqueItems" in str(error)
    assert error.param == "tools"
    lookahead = {"type": "string", "pattern": "^(?=.*[0-9]).+$"}
    error = refusal(
        response_format=schema_format({"type": "object", "properties": {"p": lookahead}})
    )
    assert "look-around" in str(error)
    error = refusal(response_format=ResponseFormat("json_schema", "{not json"))
    assert str(error).startswith("response_format.json_schema.schema: not valid JSON:")
    error = refusal(response_format=ResponseFormat("json_schema", "[1]"))
    assert str(error) == "response_format.json_schema.schema: must be a JSON object."
    error = refusal(tools=(WEATHER,), tool_choice="function", tool_name="sleep")
    assert str(error) == (
        "tool_choice names the function 'sleep', which is not among the request's tools."
    )
    assert error.param == "tool_choice"


def test_compiled_grammars_are_cached_least_recently_used_first_out(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constraint_module, "CACHE_SIZE", 2)

    def compiled(n: int) -> Any:
        schema = {"type": "object", "properties": {f"p{n}": {"type": "integer"}}}
        # The matcher itself: the same object when it came from the cache.
        return compile_for(tokenizer, response_format=schema_format(schema))._matcher

    first = compiled(1)
    assert compiled(1) is first
    compiled(2)
    assert compiled(1) is first  # now the most recently used
    compiled(3)  # evicts 2
    assert compiled(1) is first
    second = compiled(2)
    assert compiled(2) is second
    compiled(3)
    compiled(2)
    assert compiled(1) is not first


def test_an_open_think_span_comes_first(tokenizer: Any) -> None:
    request = ask("r", response_format=schema_format(SMALL))
    constraint = constraint_for(request, tokenizer, starts_in_reasoning=True)
    assert constraint is not None
    body = '{"ok": true, "n": 1, "color": "red"}'
    assert accepts(constraint, tokenizer, f"Let me think.\nRed.{tokenizer.think_end}{body}")
    assert not accepts(constraint, tokenizer, body)
