"""The model families' demo models: each builds fast and deterministically, mlx-lm loads it
and reads its tool calls and think markers as the real family's, and its chat template renders
the family's format exactly."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from orchard.cli import main
from runner.demo_families import FAMILIES, FAMILY_MODEL_VERSION, build_family_model, family_of
from runner.demo_model import resolve_model
from tests.support import REPO, UNIT

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The name of the city."},
                    "days": {"type": "integer", "description": "How many days to forecast."},
                },
                "required": ["city"],
            },
        },
    }
]

CALL = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather like in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_0001", "type": "function", "function": CALL}],
    },
    {"role": "tool", "tool_call_id": "call_0001", "content": '{"sky": "clear", "temperature": 18}'},
    {"role": "user", "content": "And in London?"},
]
"""The conversation every family's template renders (`RENDERED`): system, user, a tool call, its
result, user, and the generation prompt."""

DETECTED: dict[str, tuple[str | None, str | None, str | None, tuple[str, str] | None]] = {
    "harmony": (None, None, None, None),
    "qwen3-coder": ("qwen3_coder", "<tool_call>", "</tool_call>", ("<think>", "</think>")),
    "mistral": ("mistral", "[TOOL_CALLS]", "", None),
    "glm47": ("glm47", "<tool_call>", "</tool_call>", ("<think>", "</think>")),
    "kimi": (
        "kimi_k2",
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        ("<think>", "</think>"),
    ),
    "minimax": (
        "minimax_m2",
        "<minimax:tool_call>",
        "</minimax:tool_call>",
        ("<think>", "</think>"),
    ),
    "lfm2": ("pythonic", "<|tool_call_start|>", "<|tool_call_end|>", None),
    "gemma4": ("gemma4", "<|tool_call>", "<tool_call|>", ("<|channel>thought", "<channel|>")),
}
"""What mlx-lm makes of each, as of the real model: tool parser, call markers, think markers."""

RENDERED: dict[str, str] = {
    "harmony": (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\n"
        "\n"
        "Reasoning: medium\n"
        "\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every "
        "message.\n"
        "Calls to these tools must go to the commentary channel: 'functions'.<|end|><|start|>"
        "developer<|message|># Instructions\n"
        "\n"
        "You are a helpful assistant.\n"
        "\n"
        "# Tools\n"
        "\n"
        "## functions\n"
        "\n"
        "namespace functions {\n"
        "\n"
        "// Get the current weather in a city.\n"
        "type get_weather = (_: {\n"
        "// The name of the city.\n"
        "city: string,\n"
        "// How many days to forecast.\n"
        "days?: number,\n"
        "}) => any;\n"
        "\n"
        "} // namespace functions<|end|><|start|>user<|message|>What is the weather like in "
        "Paris?<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary "
        'json<|message|>{"city": "Paris", "days": 2}<|call|><|start|>functions.get_weather '
        'to=assistant<|channel|>commentary<|message|>{"sky": "clear", "temperature": 18}<|end|>'
        "<|start|>user<|message|>And in London?<|end|><|start|>assistant"
    ),
    "qwen3-coder": (
        "<|im_start|>system\n"
        "You are a helpful assistant.\n"
        "\n"
        "# Tools\n"
        "\n"
        "You have access to the following functions:\n"
        "\n"
        "<tools>\n"
        "<function>\n"
        "<name>get_weather</name>\n"
        "<description>Get the current weather in a city.</description>\n"
        "<parameters>\n"
        "<parameter>\n"
        "<name>city</name>\n"
        "<type>string</type>\n"
        "<description>The name of the city.</description>\n"
        "</parameter>\n"
        "<parameter>\n"
        "<name>days</name>\n"
        "<type>integer</type>\n"
        "<description>How many days to forecast.</description>\n"
        "</parameter>\n"
        '<required>["city"]</required>\n'
        "</parameters>\n"
        "</function>\n"
        "</tools>\n"
        "\n"
        "If you choose to call a function ONLY reply in the following format with NO suffix:\n"
        "\n"
        "<tool_call>\n"
        "<function=example_function_name>\n"
        "<parameter=example_parameter_1>\n"
        "value_1\n"
        "</parameter>\n"
        "<parameter=example_parameter_2>\n"
        "This is the value for the second parameter\n"
        "that can span\n"
        "multiple lines\n"
        "</parameter>\n"
        "</function>\n"
        "</tool_call>\n"
        "\n"
        "<IMPORTANT>\n"
        "Reminder:\n"
        "- Function calls MUST follow the specified format: an inner <function=...></function> "
        "block must be nested within <tool_call></tool_call> XML tags\n"
        "- Required parameters MUST be specified\n"
        "- You may provide optional reasoning for your function call in natural language BEFORE "
        "the function call, but NOT after\n"
        "- If there is no function call available, answer the question like normal with your "
        "current knowledge and do not tell the user about function calls\n"
        "</IMPORTANT><|im_end|>\n"
        "<|im_start|>user\n"
        "What is the weather like in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
        "<tool_call>\n"
        "<function=get_weather>\n"
        "<parameter=city>\n"
        "Paris\n"
        "</parameter>\n"
        "<parameter=days>\n"
        "2\n"
        "</parameter>\n"
        "</function>\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n"
        "<tool_response>\n"
        '{"sky": "clear", "temperature": 18}\n'
        "</tool_response>\n"
        "<|im_end|>\n"
        "<|im_start|>user\n"
        "And in London?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "mistral": (
        '<s>[SYSTEM_PROMPT]You are a helpful assistant.[/SYSTEM_PROMPT][AVAILABLE_TOOLS][{"type": '
        '"function", "function": {"name": "get_weather", "description": "Get the current weather '
        'in a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string", '
        '"description": "The name of the city."}, "days": {"type": "integer", "description": "How '
        'many days to forecast."}}, "required": ["city"]}}}][/AVAILABLE_TOOLS][INST]What is the '
        'weather like in Paris?[/INST][TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": '
        '2}</s>[TOOL_RESULTS]{"sky": "clear", "temperature": 18}[/TOOL_RESULTS][INST]And in '
        "London?[/INST]"
    ),
    "glm47": (
        "[gMASK]<sop><|system|>\n"
        "# Tools\n"
        "\n"
        "You may call one or more functions to assist with the user query.\n"
        "\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Get the current '
        'weather in a city.", "parameters": {"type": "object", "properties": {"city": {"type": '
        '"string", "description": "The name of the city."}, "days": {"type": "integer", '
        '"description": "How many days to forecast."}}, "required": ["city"]}}}\n'
        "</tools>\n"
        "\n"
        "For each function call, output the function name and arguments within the following XML "
        "format:\n"
        "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>"
        "{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>"
        "{arg-value-2}</arg_value>...</tool_call><|system|>You are a helpful assistant.<|user|>"
        "What is the weather like in Paris?<|assistant|></think><tool_call>get_weather<arg_key>"
        "city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value>"
        '</tool_call><|observation|><tool_response>{"sky": "clear", "temperature": '
        "18}</tool_response><|user|>And in London?<|assistant|><think>"
    ),
    "kimi": (
        '<|im_system|>tool_declare<|im_middle|>[{"type": "function", "function": {"name": '
        '"get_weather", "description": "Get the current weather in a city.", "parameters": '
        '{"type": "object", "properties": {"city": {"type": "string", "description": "The name of '
        'the city."}, "days": {"type": "integer", "description": "How many days to forecast."}}, '
        '"required": ["city"]}}}]<|im_end|><|im_system|>system<|im_middle|>You are a helpful '
        "assistant.<|im_end|><|im_user|>user<|im_middle|>What is the weather like in "
        "Paris?<|im_end|><|im_assistant|>assistant<|im_middle|><think></think>"
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argumen"
        't_begin|>{"city": "Paris", "days": 2}<|tool_call_end|><|tool_calls_section_end|>'
        "<|im_end|><|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n"
        '{"sky": "clear", "temperature": 18}<|im_end|><|im_user|>user<|im_middle|>And in '
        "London?<|im_end|><|im_assistant|>assistant<|im_middle|>"
    ),
    "minimax": (
        "]~!b[]~b]system\n"
        "You are a helpful assistant.\n"
        "\n"
        "# Tools\n"
        "You may call one or more tools to assist with the user query.\n"
        "Here are the tools available in JSONSchema format:\n"
        "\n"
        "<tools>\n"
        '<tool>{"name": "get_weather", "description": "Get the current weather in a city.", '
        '"parameters": {"type": "object", "properties": {"city": {"type": "string", '
        '"description": "The name of the city."}, "days": {"type": "integer", "description": "How '
        'many days to forecast."}}, "required": ["city"]}}</tool>\n'
        "</tools>\n"
        "\n"
        "When making tool calls, use XML format to invoke tools and pass parameters:\n"
        "\n"
        "<minimax:tool_call>\n"
        '<invoke name="tool-name-1">\n'
        '<parameter name="param-key-1">param-value-1</parameter>\n'
        '<parameter name="param-key-2">param-value-2</parameter>\n'
        "...\n"
        "</invoke>\n"
        "</minimax:tool_call>[e~[\n"
        "]~b]user\n"
        "What is the weather like in Paris?[e~[\n"
        "]~b]ai\n"
        "\n"
        "<minimax:tool_call>\n"
        '<invoke name="get_weather">\n'
        '<parameter name="city">Paris</parameter>\n'
        '<parameter name="days">2</parameter>\n'
        "</invoke>\n"
        "</minimax:tool_call>[e~[\n"
        "]~b]tool\n"
        '<response>{"sky": "clear", "temperature": 18}</response>[e~[\n'
        "]~b]user\n"
        "And in London?[e~[\n"
        "]~b]ai\n"
        "<think>\n"
    ),
    "lfm2": (
        "<|startoftext|><|im_start|>system\n"
        "You are a helpful assistant.\n"
        'List of tools: <|tool_list_start|>[{"type": "function", "function": {"name": '
        '"get_weather", "description": "Get the current weather in a city.", "parameters": '
        '{"type": "object", "properties": {"city": {"type": "string", "description": "The name of '
        'the city."}, "days": {"type": "integer", "description": "How many days to forecast."}}, '
        '"required": ["city"]}}}]<|tool_list_end|><|im_end|>\n'
        "<|im_start|>user\n"
        "What is the weather like in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<|tool_call_start|>[get_weather(city="Paris", days=2)]<|tool_call_end|><|im_end|>\n'
        "<|im_start|>tool\n"
        '<|tool_response_start|>{"sky": "clear", "temperature": 18}<|tool_response_end|><|im_end|>'
        "\n"
        "<|im_start|>user\n"
        "And in London?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "gemma4": (
        "<bos><|turn>system\n"
        "<|think|>\n"
        'You are a helpful assistant.<|tool>declaration:get_weather{description:<|"|>Get the '
        'current weather in a city.<|"|>,parameters:{properties:{city:{description:<|"|>The name '
        'of the city.<|"|>,type:<|"|>STRING<|"|>},days:{description:<|"|>How many days to '
        'forecast.<|"|>,type:<|"|>INTEGER<|"|>}},required:[<|"|>city<|"|>],type:<|"|>OBJECT<|"|>'
        "}}<tool|><turn|>\n"
        "<|turn>user\n"
        "What is the weather like in Paris?<turn|>\n"
        "<|turn>model\n"
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|><|tool_response>'
        'response:get_weather{value:<|"|>{"sky": "clear", "temperature": 18}<|"|>}<tool_response|>'
        "<|turn>user\n"
        "And in London?<turn|>\n"
        "<|turn>model\n"
    ),
}
"""What `MESSAGES` renders to, family by family, in the real family's format."""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every family's model, built once."""
    root = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        build_family_model(family, root / family)
    return {family: root / family for family in FAMILIES}


@pytest.fixture(scope="module")
def loads(built: dict[str, Path]) -> dict[str, tuple[Any, Any]]:
    """Each family's model and tokenizer as `mlx_lm.load` gives them, loaded on first use."""
    from mlx_lm import load

    class Loads(dict[str, tuple[Any, Any]]):
        def __missing__(self, family: str) -> tuple[Any, Any]:
            loaded: Any = load(str(built[family]))  # annotated as a 2- or 3-tuple
            self[family] = (loaded[0], loaded[1])
            return self[family]

    return Loads()


def markers(family: str) -> tuple[str, ...]:
    spec = FAMILIES[family]
    return spec.special_tokens + spec.added_tokens


def test_the_families() -> None:
    assert sorted(FAMILIES) == sorted(DETECTED)
    for family, spec in FAMILIES.items():
        assert spec.model_id == f"orchard-demo-{family}"
        assert family_of(spec.model_id) == family
        assert spec.config["model_type"] == spec.model_type
        parser, _, _, think = DETECTED[family]
        assert (spec.tool_parser, spec.think) == (parser, think)
    assert family_of("orchard-demo") is None


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mlx_lm_reads_the_family_as_the_real_model(
    loads: dict[str, tuple[Any, Any]], family: str
) -> None:
    _, tokenizer = loads[family]
    parser, start, end, think = DETECTED[family]
    if parser is None:
        assert tokenizer.tool_parser is None
    else:
        assert tokenizer.tool_parser.__module__ == f"mlx_lm.tool_parsers.{parser}"
    assert (tokenizer.tool_call_start, tokenizer.tool_call_end) == (start, end)
    assert tokenizer.has_thinking == (think is not None)
    assert (tokenizer.think_start, tokenizer.think_end) == (think or (None, None))
    spec = FAMILIES[family]
    stops = {tokenizer.convert_tokens_to_ids(token) for token in spec.stops}
    assert tokenizer.eos_token_ids == stops | {tokenizer.convert_tokens_to_ids(spec.eos)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_special_token_is_one_token(loads: dict[str, tuple[Any, Any]], family: str) -> None:
    _, tokenizer = loads[family]
    assert len(tokenizer.get_vocab()) == 1024
    for marker in markers(family):
        ids = tokenizer.encode(marker, add_special_tokens=False)
        assert ids == [tokenizer.convert_tokens_to_ids(marker)], marker
    # Nothing is added around a prompt: each template writes its own start.
    assert tokenizer.encode("hello") == tokenizer.encode("hello", add_special_tokens=False)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_template_renders_the_family_format(
    loads: dict[str, tuple[Any, Any]], family: str
) -> None:
    _, tokenizer = loads[family]
    # As Orchard renders it: through mlx-lm's wrapper, which sets enable_thinking to whether
    # the model thinks.
    text = tokenizer.apply_chat_template(
        copy.deepcopy(MESSAGES), tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert text == RENDERED[family]


def _call_text(family: str, tokenizer: Any, text: str) -> str:
    """The text mlx-lm hands its tool parser for the last call in `text`: between the call
    markers (Mistral's calls end at the end of the message)."""
    start = text.rindex(tokenizer.tool_call_start) + len(tokenizer.tool_call_start)
    end_marker = tokenizer.tool_call_end or FAMILIES[family].eos
    return text[start : text.index(end_marker, start)]


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"harmony"}))
def test_a_rendered_tool_call_parses_back(loads: dict[str, tuple[Any, Any]], family: str) -> None:
    _, tokenizer = loads[family]
    text = tokenizer.apply_chat_template(copy.deepcopy(MESSAGES[:3]), tools=TOOLS, tokenize=False)
    parsed = tokenizer.tool_parser(_call_text(family, tokenizer, text), TOOLS)
    (call,) = parsed if isinstance(parsed, list) else [parsed]
    assert {"name": call["name"], "arguments": call["arguments"]} == CALL


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_arguments_given_as_json_text(loads: dict[str, tuple[Any, Any]], family: str) -> None:
    _, tokenizer = loads[family]
    as_text = copy.deepcopy(MESSAGES)
    as_text[2]["tool_calls"][0]["function"]["arguments"] = json.dumps(CALL["arguments"])
    text = tokenizer.apply_chat_template(
        as_text, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    if family in ("harmony", "mistral", "kimi"):  # JSON in the format: the same text
        assert text == RENDERED[family]
    else:  # the text where the arguments go, no failure
        assert json.dumps(CALL["arguments"]) in text


REASONING = [
    {"role": "user", "content": "What is the weather like in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "The user wants the sky over Paris.",
        "tool_calls": [{"id": "call_0001", "type": "function", "function": CALL}],
    },
    {"role": "tool", "tool_call_id": "call_0001", "content": "clear"},
]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_reasoning_of_the_current_turn_is_kept(
    loads: dict[str, tuple[Any, Any]], family: str
) -> None:
    _, tokenizer = loads[family]
    text = tokenizer.apply_chat_template(
        copy.deepcopy(REASONING), tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    # Qwen3-Coder, Devstral and LFM2 do not think; the others keep a tool call's reasoning
    # until the answer that follows it.
    kept = family not in ("qwen3-coder", "mistral", "lfm2")
    assert ("The user wants the sky over Paris." in text) == kept
    # Once answered, and a new question asked, the reasoning is gone.
    answered = [
        *copy.deepcopy(REASONING),
        {"role": "assistant", "content": "Clear skies."},
        {"role": "user", "content": "Thanks!"},
    ]
    text = tokenizer.apply_chat_template(
        answered, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert "The user wants the sky over Paris." not in text


def test_reasoning_switches(loads: dict[str, tuple[Any, Any]]) -> None:
    def render(family: str, **kwargs: Any) -> str:
        _, tokenizer = loads[family]
        messages = [{"role": "user", "content": "Hello"}]
        text: str = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **kwargs
        )
        return text

    assert "Reasoning: medium" in render("harmony")
    assert "Reasoning: high" in render("harmony", reasoning_effort="high")
    assert render("glm47").endswith("<|assistant|><think>")
    assert render("glm47", enable_thinking=False).endswith("<|assistant|></think>")
    assert render("minimax").endswith("]~b]ai\n<think>\n")
    assert render("minimax", enable_thinking=False).endswith("]~b]ai\n<think>\n</think>\n\n")
    assert "<|think|>" in render("gemma4")
    off = render("gemma4", enable_thinking=False)
    assert "<|think|>" not in off
    assert off.endswith("<|turn>model\n<|channel>thought\n<channel|>")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_decoding_writes_no_markup_by_itself(
    loads: dict[str, tuple[Any, Any]], family: str
) -> None:
    from mlx_lm import stream_generate

    model, tokenizer = loads[family]
    prompt = tokenizer.apply_chat_template(
        copy.deepcopy(MESSAGES), tools=TOOLS, add_generation_prompt=True
    )
    tokens = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=8)]
    assert len(tokens) == 8  # no end of sequence either: the end markers are markers too
    marker_ids = {tokenizer.convert_tokens_to_ids(marker) for marker in markers(family)}
    assert not marker_ids & set(tokens), tokenizer.decode(tokens)


def test_a_build_is_deterministic(tmp_path: Path, built: dict[str, Path]) -> None:
    # In a process of its own (its own hash seed, MLX state and pid).
    build = "import pathlib, sys; from runner.demo_families import build_family_model;"
    build += " build_family_model('kimi', pathlib.Path(sys.argv[1]))"
    subprocess.run(
        [sys.executable, "-c", build, str(tmp_path / "again")],
        cwd=REPO,
        check=True,
        timeout=120 * UNIT,
    )
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == sorted(FILES)
    for name in FILES:
        assert (tmp_path / "again" / name).read_bytes() == (built["kimi"] / name).read_bytes()


def test_the_command_writes_a_family_model(
    tmp_path: Path, orchard_cache: Path, built: dict[str, Path]
) -> None:
    from mlx_lm import load

    target = tmp_path / "lfm2"
    result = CliRunner().invoke(main, ["demo-model", "--family", "lfm2", str(target)])
    assert result.exit_code == 0, result.output
    assert f"wrote orchard-demo-lfm2 to {target}" in result.output
    # A copy of the cache's build, which resolve_model made and keeps.
    cached = orchard_cache / "models" / f"orchard-demo-lfm2-{FAMILY_MODEL_VERSION}"
    assert resolve_model("orchard-demo-lfm2") == str(cached)
    for name in FILES:
        assert (target / name).read_bytes() == (built["lfm2"] / name).read_bytes(), name
        assert (cached / name).read_bytes() == (built["lfm2"] / name).read_bytes(), name
    loaded: Any = load(str(target))
    assert loaded[1].tool_call_start == "<|tool_call_start|>"
