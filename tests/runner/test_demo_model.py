"""The built-in model: builds deterministically, loads with mlx-lm, is fast enough to test on."""

from __future__ import annotations

import math
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
    TOOL_DEMO_CALLS,
    TOOL_DEMO_MESSAGES,
    TOOL_DEMO_PARALLEL_CALLS,
    TOOL_DEMO_PARALLEL_MESSAGES,
    TOOL_DEMO_TOOLS,
    resolve_model,
    tool_calls_text,
)
from tests.runner.demo import FILES
from tests.runner.engines import Reference
from tests.support import REPO, UNIT


@pytest.fixture(scope="module")
def loaded(reference: Reference) -> tuple[Any, Any]:
    """The built-in model and its tokenizer, as mlx-lm loads them (the session's load)."""
    return reference.model, reference.tokenizer


def test_build_is_deterministic(tmp_path: Path, demo_model_path: Path) -> None:
    # In a process of its own (its own hash seed, MLX state and pid), which the session's
    # build may not have been.
    build = "import pathlib, sys; from runner.demo_model import build_demo_model;"
    build += " build_demo_model(pathlib.Path(sys.argv[1]))"
    subprocess.run(
        [sys.executable, "-c", build, str(tmp_path / "again")],
        cwd=REPO,
        check=True,
        timeout=300 * UNIT,
    )
    for name in FILES:
        assert (tmp_path / "again" / name).read_bytes() == (demo_model_path / name).read_bytes()


def test_resolve_model(orchard_cache: Path, demo_model_path: Path) -> None:
    assert demo_model_path == orchard_cache / "models" / f"{DEMO_MODEL_ID}-{DEMO_MODEL_VERSION}"
    built_at = (demo_model_path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(DEMO_MODEL_ID) == str(demo_model_path)
    assert (demo_model_path / "model.safetensors").stat().st_mtime_ns == built_at
    assert resolve_model("mlx-community/Qwen3-0.6B-4bit") == "mlx-community/Qwen3-0.6B-4bit"
    assert resolve_model("/models/local") == "/models/local"


RACER = """
import pathlib, sys, time
import runner.demo_model as demo

me, other, *files = map(pathlib.Path, sys.argv[1:])

def build(path):
    # In the staging directory: wait until the other racer is in its own, then write.
    me.touch()
    deadline = time.monotonic() + 60
    while not other.exists():
        if time.monotonic() > deadline:
            sys.exit("the other racer never started its build")
        time.sleep(0.01)
    for name in files:
        (path / name).write_text(str(me))

demo.build_demo_model = build  # the real build takes 15-50 s; the race is in resolve_model
print(demo.resolve_model(demo.DEMO_MODEL_ID))
"""
"""A process that builds the built-in model into $ORCHARD_CACHE_DIR, once the other racer is
building too; each file it writes holds its own marker's path."""


def test_processes_racing_to_build_both_succeed(tmp_path: Path) -> None:
    env = {**os.environ, "ORCHARD_CACHE_DIR": str(tmp_path / "cache")}
    markers = [tmp_path / "racer-0", tmp_path / "racer-1"]
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(me), str(other), *FILES],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for me, other in (markers, markers[::-1])
    ]
    outputs = [racer.communicate(timeout=60 * UNIT)[0].strip() for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0]
    models = tmp_path / "cache" / "models"
    target = models / f"{DEMO_MODEL_ID}-{DEMO_MODEL_VERSION}"
    assert outputs == [str(target), str(target)]
    # Only the model directory: the loser's staging directory is gone.
    assert [p.name for p in models.iterdir()] == [target.name]
    assert sorted(p.name for p in target.iterdir()) == sorted(FILES)
    # All of it the winner's: no mix of the two builds.
    (winner,) = {(target / name).read_text() for name in FILES}
    assert winner in {str(marker) for marker in markers}


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


MARKERS = (
    "<|im_end|>",
    "<|im_start|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
)


def generate(
    loaded: tuple[Any, Any], prompt: list[int], max_tokens: int, temperature: float = 0.0
) -> list[Any]:
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = loaded
    sampler = make_sampler(temperature)
    return list(stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=sampler))


@pytest.mark.parametrize("content", ["Hello", "What is the weather like in Paris today?"])
def test_greedy_generation_is_varied_and_never_ends_by_itself(
    loaded: tuple[Any, Any], content: str
) -> None:
    _, tokenizer = loaded
    messages = [{"role": "user", "content": content}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    responses = generate(loaded, prompt, 200)
    tokens = [r.token for r in responses]
    assert len(tokens) == 200
    assert responses[-1].finish_reason == "length"
    markers = {tokenizer.convert_tokens_to_ids(t) for t in MARKERS}
    assert not markers & set(tokens)
    assert len(set(tokens)) > 10  # nonsense, but not one token over and over
    text = "".join(r.text for r in responses)
    assert "\ufffd" not in text
    # It never starts JSON by itself (nor a tool call: there are no tools).
    assert not set(text) & set('{}[]"')


def test_sampled_text_is_varied_and_has_no_markers(loaded: tuple[Any, Any]) -> None:
    import mlx.core as mx

    _, tokenizer = loaded
    messages = [{"role": "user", "content": "Hello"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    markers = {tokenizer.convert_tokens_to_ids(t) for t in MARKERS}
    texts = []
    for seed in range(4):
        mx.random.seed(seed)
        responses = generate(loaded, prompt, 100, temperature=1.0)
        assert len(responses) == 100
        assert not markers & {r.token for r in responses}
        texts.append("".join(r.text for r in responses))
    assert len(set(texts)) == 4


@pytest.mark.parametrize(
    ("messages", "calls"),
    [
        (TOOL_DEMO_MESSAGES, TOOL_DEMO_CALLS),
        (TOOL_DEMO_PARALLEL_MESSAGES, TOOL_DEMO_PARALLEL_CALLS),
    ],
    ids=["one call", "two calls"],
)
def test_greedy_decoding_calls_the_demo_tool(
    loaded: tuple[Any, Any], messages: tuple[dict[str, Any], ...], calls: tuple[dict[str, Any], ...]
) -> None:
    _, tokenizer = loaded
    prompt = tokenizer.apply_chat_template(
        list(messages), tools=list(TOOL_DEMO_TOOLS), add_generation_prompt=True
    )
    responses = generate(loaded, prompt, 100)
    tokens = [r.token for r in responses]
    assert tokens[-1] == tokenizer.eos_token_id
    assert responses[-1].finish_reason == "stop"
    assert tokenizer.decode(tokens[:-1]) == tool_calls_text(calls)
    assert len(calls) == len(TOOL_DEMO_CALLS) + (messages is TOOL_DEMO_PARALLEL_MESSAGES)


def string_mask(texts: list[str], vocab_size: int) -> Any:
    """Tokens that keep a JSON string open, or close it (then at most `,:}]` and spaces)."""
    import mlx.core as mx

    def allowed(text: str) -> bool:
        inside, quote, after = text.partition('"')
        return (
            bool(text)
            and "\\" not in inside
            and all(ord(char) >= 0x20 for char in inside)
            and (not quote or set(after) <= set(",:}] "))
        )

    mask = [0.0 if allowed(text) else -math.inf for text in texts]
    return mx.array(mask + [-math.inf] * (vocab_size - len(mask)))


@pytest.mark.parametrize("content", ["Hello", "Give me a user record.", "List three fruits."])
def test_a_json_string_closes_quickly_under_a_mask(loaded: tuple[Any, Any], content: str) -> None:
    """As under a grammar: greedy decoding of a string value closes it within a few tokens."""
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = loaded
    texts = [tokenizer.decode([i]) for i in range(len(tokenizer.get_vocab()))]
    texts = [text if text not in MARKERS else "\x00" for text in texts]  # never allowed
    mask = string_mask(texts, model.args.vocab_size)
    messages = [{"role": "user", "content": content}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt += tokenizer.encode('{"city": "', add_special_tokens=False)
    responses = generate_masked(loaded, prompt, 20, mask, make_sampler(0.0))
    # Closed within the 20 tokens (it takes 2 to 5 here).
    assert any('"' in texts[r.token] for r in responses), "".join(r.text for r in responses)


def generate_masked(
    loaded: tuple[Any, Any], prompt: list[int], max_tokens: int, mask: Any, sampler: Any
) -> list[Any]:
    from mlx_lm import stream_generate

    model, tokenizer = loaded
    return list(
        stream_generate(
            model,
            tokenizer,
            prompt,
            max_tokens=max_tokens,
            sampler=sampler,
            logits_processors=[lambda tokens, logits: logits + mask],
        )
    )


def test_the_added_part_adds_nothing_to_ordinary_text(loaded: tuple[Any, Any]) -> None:
    """Without the trained part (its layers and output columns zeroed) an ordinary prompt's
    logits are exactly the same; once a JSON token is in the context they are not."""
    import mlx.core as mx
    import mlx.utils

    from runner import demo_shaping

    model, tokenizer = loaded
    messages = [{"role": "user", "content": "Tell me about apples."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    json_prompt = prompt + tokenizer.encode('{"name', add_special_tokens=False)
    weights = dict(mlx.utils.tree_flatten(model.parameters()))
    added = tuple(
        f"model.layers.{i}."
        for i in range(model.args.num_hidden_layers - demo_shaping.NEW_LAYERS, 99)
    )
    old_columns = mx.arange(demo_shaping.WIDTH) < demo_shaping.OLD_DIMS
    without = [(name, mx.zeros_like(w)) for name, w in weights.items() if name.startswith(added)]
    without.append(("lm_head.weight", weights["lm_head.weight"] * old_columns))
    before = [model(mx.array([p]))[0, -1] for p in (prompt, json_prompt)]
    try:
        model.update(mlx.utils.tree_unflatten(without))
        after = [model(mx.array([p]))[0, -1] for p in (prompt, json_prompt)]
    finally:
        model.update(mlx.utils.tree_unflatten(list(weights.items())))
    assert mx.array_equal(before[0], after[0])
    assert not mx.allclose(before[1], after[1])


@pytest.mark.timing  # a speed the other tests' durations rely on
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
