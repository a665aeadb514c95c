"""The built-in model: builds deterministically, loads with mlx-lm, is fast enough to test on."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from runner.demo_model import (
    CHAT_TEMPLATE,
    DEMO_MODEL_ID,
    DEMO_MODEL_VERSION,
    TOOL_DEMO_MESSAGES,
    TOOL_DEMO_TOOLS,
    build_demo_model,
    resolve_model,
    tool_calls_text,
)
from tests.support import UNIT

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def loaded(demo_model_path: Path) -> tuple[Any, Any]:
    import mlx_lm

    loaded: Any = mlx_lm.load(str(demo_model_path))  # annotated as a 2- or 3-tuple
    return loaded[0], loaded[1]


def test_build_is_deterministic(tmp_path: Path, demo_model_path: Path) -> None:
    build_demo_model(tmp_path / "again")
    for name in FILES:
        assert (tmp_path / "again" / name).read_bytes() == (demo_model_path / name).read_bytes()


def test_resolve_model(orchard_cache: Path, demo_model_path: Path) -> None:
    assert demo_model_path == orchard_cache / "models" / f"{DEMO_MODEL_ID}-{DEMO_MODEL_VERSION}"
    built_at = (demo_model_path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(DEMO_MODEL_ID) == str(demo_model_path)
    assert (demo_model_path / "model.safetensors").stat().st_mtime_ns == built_at
    assert resolve_model("mlx-community/Qwen3-0.6B-4bit") == "mlx-community/Qwen3-0.6B-4bit"
    assert resolve_model("/models/local") == "/models/local"


def test_processes_racing_to_build_both_succeed(tmp_path: Path) -> None:
    script = "from runner.demo_model import resolve_model; print(resolve_model('orchard-demo'))"
    env = {**os.environ, "ORCHARD_CACHE_DIR": str(tmp_path)}
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        for _ in range(2)
    ]
    outputs = [racer.communicate(timeout=60 * UNIT)[0].strip() for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0]
    target = tmp_path / "models" / f"{DEMO_MODEL_ID}-{DEMO_MODEL_VERSION}"
    assert outputs == [str(target), str(target)]
    # Only the model directory: the loser's staging directory is gone.
    assert [p.name for p in (tmp_path / "models").iterdir()] == [target.name]
    assert sorted(p.name for p in target.iterdir()) == sorted(FILES)


def test_tokenizer(loaded: tuple[Any, Any]) -> None:
    from transformers import PreTrainedTokenizerFast

    _, tokenizer = loaded
    assert isinstance(tokenizer._tokenizer, PreTrainedTokenizerFast)
    assert tokenizer.has_thinking
    assert tokenizer.think_start_id == tokenizer.convert_tokens_to_ids("<think>")
    assert tokenizer.think_end_id == tokenizer.convert_tokens_to_ids("</think>")
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    assert tokenizer.chat_template == CHAT_TEMPLATE
    markers = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    added = ("<think>", "</think>", "<tool_call>", "</tool_call>")
    for marker in markers + added:
        assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1
    # The added markers are text, as in Qwen: decoding keeps them even when skipping specials.
    for marker in added:
        ids = tokenizer.encode(f"a{marker}b", add_special_tokens=False)
        assert tokenizer.decode(ids, skip_special_tokens=True) == f"a{marker}b"
    assert len(tokenizer.get_vocab()) == 1024
    # No BOS is added: ChatML prompts start with <|im_start|>.
    assert tokenizer.encode("hello world") == tokenizer.encode(
        "hello world", add_special_tokens=False
    )
    text = "The orchard, in spring: 5 apples & ünïcödé!"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_chat_template(loaded: tuple[Any, Any]) -> None:
    _, tokenizer = loaded
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert tokenizer.decode(tokens) == prompt
    # Thinking off (chat_template_kwargs), as Qwen3: an empty think span opens the answer.
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, enable_thinking=True
    ) == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


TOOLS_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Get the current '
    'weather in a city.", "parameters": {"type": "object", "properties": {"city": {"type": '
    '"string", "description": "The name of the city."}}, "required": ["city"]}}}\n'
    '{"type": "function", "function": {"name": "get_time", "parameters": {}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)
"""The system turn's text with TOOLS below (Qwen2.5-Instruct's, word for word)."""

TOOLS = [
    *TOOL_DEMO_TOOLS,
    {"type": "function", "function": {"name": "get_time", "parameters": {}}},
]


def test_chat_template_with_tools(loaded: tuple[Any, Any]) -> None:
    _, tokenizer = loaded
    user = {"role": "user", "content": "Weather in Paris?"}

    def render(messages: list[dict[str, Any]], **options: Any) -> str:
        text: str = tokenizer.apply_chat_template(messages, tokenize=False, **options)
        return text

    # The tools open the system turn, before the system message if there is one.
    assert render([user], tools=TOOLS, add_generation_prompt=True) == (
        "<|im_start|>system\n" + TOOLS_SYSTEM + "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    system = {"role": "system", "content": "Be brief."}
    assert render([system, user], tools=TOOLS) == (
        "<|im_start|>system\nBe brief.\n\n" + TOOLS_SYSTEM + "<|im_start|>user\n"
        "Weather in Paris?<|im_end|>\n"
    )
    # Without tools, plain ChatML: no system turn is made up.
    assert render([user], tools=None) == "<|im_start|>user\nWeather in Paris?<|im_end|>\n"

    # An assistant's calls (transformers' shape, and Qwen's bare one; arguments as a dict or
    # as JSON text), then the tool messages: one user turn of responses.
    conversation: list[dict[str, Any]] = [
        user,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {"name": "get_time", "arguments": '{"city": "Paris"}'},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "tool", "content": "10:30"},
        {"role": "assistant", "content": "Sunny."},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_time", "arguments": {}}},
            ],
        },
        {"role": "tool", "content": "10:31"},
    ]
    assert render(conversation, tools=TOOLS, add_generation_prompt=True) == (
        "<|im_start|>system\n" + TOOLS_SYSTEM + "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>\n"
        "<tool_response>\n10:30\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nSunny.<|im_end|>\n"
        "<|im_start|>assistant\nLet me look.\n<tool_call>\n"
        '{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n10:31\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # tool_calls_text writes calls as the template does.
    calls = [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert render([user, {"role": "assistant", "tool_calls": calls}], tools=TOOLS).endswith(
        "<|im_start|>assistant\n" + tool_calls_text(calls) + "<|im_end|>\n"
    )


def test_mlx_lm_reads_the_tool_call_format(loaded: tuple[Any, Any]) -> None:
    from mlx_lm.tool_parsers import json_tools

    _, tokenizer = loaded
    assert tokenizer.has_tool_calling
    assert tokenizer.tool_call_start == "<tool_call>"
    assert tokenizer.tool_call_end == "</tool_call>"
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    inner = tool_calls_text([call]).removeprefix("<tool_call>").removesuffix("</tool_call>")
    assert tokenizer.tool_parser(inner) == call
    assert tokenizer.tool_parser is json_tools.parse_tool_call
    prompt = tokenizer.apply_chat_template(
        list(TOOL_DEMO_MESSAGES), tools=list(TOOL_DEMO_TOOLS), add_generation_prompt=True
    )
    assert tokenizer.decode(prompt).startswith("<|im_start|>system\n# Tools\n")


def test_greedy_generation_is_varied_and_never_ends_by_itself(loaded: tuple[Any, Any]) -> None:
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
    responses = list(
        stream_generate(model, tokenizer, prompt, max_tokens=200, sampler=make_sampler(0.0))
    )
    tokens = [r.token for r in responses]
    assert len(tokens) == 200
    assert responses[-1].finish_reason == "length"
    markers = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<think>", "</think>")}
    assert not markers & set(tokens)
    assert len(set(tokens)) > 10  # nonsense, but not one token over and over
    text = "".join(r.text for r in responses)
    assert "\ufffd" not in text


def test_single_stream_speed(loaded: tuple[Any, Any]) -> None:
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
    list(stream_generate(model, tokenizer, prompt, max_tokens=20))  # warm-up
    stream = stream_generate(model, tokenizer, prompt, max_tokens=301, sampler=make_sampler(0.0))
    next(stream)  # the prompt: timed from the first token on
    started = time.perf_counter()
    assert len(list(stream)) == 300
    tokens_per_second = 300 / (time.perf_counter() - started)
    assert tokens_per_second > 100 / UNIT, f"{tokens_per_second:.0f} tok/s"
