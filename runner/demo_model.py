"""The built-in model "orchard-demo": a tiny Llama that needs no download.

It exists so that a fresh install, the tests and CI can run the whole system end to end on any
machine. It writes nonsense, quickly and deterministically, except where a test of JSON or
tool calls needs it to act like a real model:

- a random model writes the nonsense: `mlx_lm.models.llama.Model` (64 wide, 2 layers) after
  `mx.random.seed(0)`; the final norm is scaled up so the logits are peaked (greedy decoding
  does not hinge on rounding), and the output rows of the markers, of JSON tokens (`{"`, `]`,
  ...), of bare whitespace and of non-text byte tokens are zero, so it practically never picks
  them by itself (greedy decoding never does). In particular it does not end on its own: it
  runs until `max_tokens` (tests force an end with a logit bias on `<|im_end|>`);
- `runner.demo_shaping` widens it to 96 and adds two layers, trained at build time for some
  seconds (seeded, so every build on a machine is the same): once a JSON token is in the
  context (a grammar's `{`, tools in the system turn), the added part takes over and writes
  short JSON that closes (one key, mostly), and greedy decoding answers `TOOL_DEMO_MESSAGES`
  and `TOOL_DEMO_PARALLEL_MESSAGES` (with `TOOL_DEMO_TOOLS`) with their calls, then
  `<|im_end|>`. With no JSON token in the context the added part adds exactly nothing;
- the tokenizer is a byte-level BPE trained here, with `tokenizers`, on the fixed corpus below;
  `<think>` and `</think>` are single tokens, so mlx-lm detects a thinking model; its corpus
  has a JSON passage, so that JSON takes few tokens (`{"`, `":`, ` "`, `"}}`);
- the chat template is ChatML: `<|im_start|>role\\ncontent<|im_end|>\\n` per message, and
  `<|im_start|>assistant\\n` as the generation prompt; `<|im_end|>` is the end-of-sequence token.
  With tools it is Qwen2.5-Instruct's (Hermes) template: the tools in the system turn, calls as
  `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` (single tokens, so mlx-lm
  reads them with its `json_tools` parser), tool results as `<tool_response>` in a user turn.
  `enable_thinking=False` (chat_template_kwargs) opens the answer with an empty think span.

`resolve_model` maps the name `DEMO_MODEL_ID` to a directory under the cache, building it on
first use; every other name goes to `mlx_lm.load` unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner import demo_corpus
from runner.demo_corpus import CORPUS, silent_token_ids

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# mlx, mlx-lm and tokenizers are imported where the model is built: the name and the cache
# path are needed by the `orchard` command, which must start fast.

DEMO_MODEL_ID = "orchard-demo"
DEMO_MODEL_VERSION = "v3"
"""Part of the cache directory name: bump it whenever the built files change."""

DEMO_PIPELINE_MODEL_ID = "orchard-demo-qwen2"
"""The same model in Qwen2's layout (zero q/k/v biases): mlx-lm's Llama cannot be split into
pipeline stages, its Qwen2 can, so runner groups and their tests split this one."""

DEMO_LONG_MODEL_ID = "orchard-demo-32k"
"""The same model with a 32,768-token context (`LONG_CONTEXT`): the same weights, only its
config's `max_position_embeddings` differs. For the long-context benchmarks (`just bench
agent`): the built-in model's 2,048 tokens hold no agent session."""
LONG_CONTEXT = 32_768

DEMO_DEEP_MODEL_ID = "orchard-demo-deep"
"""The built-in model's logits exactly, from 8 times its layers: the extra ones' attention and
MLP write nothing to the residual stream (zero output projections), so each step costs as a
deep model's while the built-in model, as its draft, always agrees (`just bench
speculative`: a small draft that agrees with a big model, as a 0.5B one does with its 7B)."""
DEEP_LAYERS = 32

DEMO_DRAFT_MODEL_ID = "orchard-demo-draft"
"""Another random model with the built-in model's tokenizer, one layer deep: a draft model that
rarely agrees with it (`orchard runner --draft-model`, `just bench speculative`). The built-in
model as its own draft is the one that always agrees."""

CACHE_DIR_ENV = "ORCHARD_CACHE_DIR"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

_SPECIAL = (ENDOFTEXT, IM_START, IM_END)
# Not special, as in Qwen3: decoding with skip_special_tokens keeps them, like any text.
_ADDED = (THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END)
_MARKERS = _SPECIAL + _ADDED

CONTEXT_LENGTH = demo_corpus.CONTEXT_LENGTH
"""The built-in model's context, in tokens (every demo model's)."""


# Qwen2.5-Instruct's template (Hermes-style tool calls), without its default system message so
# that plain conversations stay the ChatML above, and with Qwen3's `enable_thinking` switch.
# mlx-lm picks its `json_tools` parser for it: the text holds `<tool_call>` and `tool_call.name`.
CHAT_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and '
        'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
        '<function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'system' and loop.first and tools %}
    {%- elif message['role'] == 'assistant' and message['tool_calls'] %}
        {{- '<|im_start|>assistant' }}
        {%- if message['content'] %}
            {{- '\n' + message['content'] }}
        {%- endif %}
        {%- for tool_call in message['tool_calls'] %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message['role'] == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
""".strip()

_VOCAB_SIZE = 1024
_LOGIT_SCALE = 10.0
"""Multiplies the final norm: logits spread over tens (std ~6), not units, so greedy decoding
is robust to rounding while temperature-1 sampling still varies."""

BASE_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": CONTEXT_LENGTH,
    # Untied: with random tied embeddings the model echoes its input ("\n\n\n..."); a separate
    # head gives varied nonsense.
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
"""The base model's Llama config, before `demo_shaping` widens it; the vocabulary size and the
special token ids come from the tokenizer."""

TOOL_DEMO_TOOLS: tuple[dict[str, Any], ...] = (
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The name of the city."}},
                "required": ["city"],
            },
        },
    },
)
"""The tools of the conversations below (OpenAI's shape, as transformers' templates take them)."""

TOOL_DEMO_MESSAGES: tuple[dict[str, Any], ...] = (
    {"role": "user", "content": "What is the weather like in Paris today?"},
)
"""With `TOOL_DEMO_TOOLS`, greedy decoding answers `TOOL_DEMO_CALLS` (then `<|im_end|>`)."""

TOOL_DEMO_CALLS: tuple[dict[str, Any], ...] = (
    {"name": "get_weather", "arguments": {"city": "Paris"}},
)

TOOL_DEMO_PARALLEL_MESSAGES: tuple[dict[str, Any], ...] = (
    {"role": "user", "content": 'What is the weather like in these cities: ["Paris", "London"]?'},
)
"""With `TOOL_DEMO_TOOLS`, greedy decoding answers `TOOL_DEMO_PARALLEL_CALLS`: two calls."""

TOOL_DEMO_PARALLEL_CALLS: tuple[dict[str, Any], ...] = (
    {"name": "get_weather", "arguments": {"city": "Paris"}},
    {"name": "get_weather", "arguments": {"city": "London"}},
)


def tool_calls_text(calls: Sequence[dict[str, Any]]) -> str:
    """Tool calls in the model's markup, as the chat template writes an assistant's
    `tool_calls` (each `{"name", "arguments"}`, arguments a dict), without `<|im_end|>`."""
    return "\n".join(
        f"{TOOL_CALL_START}\n"
        + json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)
        + f"\n{TOOL_CALL_END}"
        for call in calls
    )


def cache_dir() -> Path:
    """Where Orchard keeps built and downloaded files: `$ORCHARD_CACHE_DIR` or ~/.cache/orchard."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "orchard"


def is_builtin(name: str) -> bool:
    """Whether `name` is one of the built-in models (built here, never downloaded)."""
    from runner import demo_families

    builtin = (
        DEMO_MODEL_ID,
        DEMO_PIPELINE_MODEL_ID,
        DEMO_LONG_MODEL_ID,
        DEMO_DRAFT_MODEL_ID,
        DEMO_DEEP_MODEL_ID,
    )
    return name in builtin or demo_families.family_of(name) is not None


def resolve_model(name: str) -> str:
    """What to pass to `mlx_lm.load` for a model name.

    `DEMO_MODEL_ID`, `DEMO_PIPELINE_MODEL_ID`, `DEMO_LONG_MODEL_ID` and the model families'
    `orchard-demo-<family>` (`runner.demo_families`) become their directories in the cache,
    built on first use; any other name (a local MLX directory or a Hugging Face id) is returned
    unchanged.
    """
    from runner import demo_families

    family = demo_families.family_of(name)
    if family is not None:
        target = cache_dir() / "models" / f"{name}-{demo_families.FAMILY_MODEL_VERSION}"
        if not target.is_dir():
            _build_atomically(target, lambda path: demo_families.build_family_model(family, path))
        return str(target)
    if not is_builtin(name):
        return name
    target = cache_dir() / "models" / f"{DEMO_MODEL_ID}-{DEMO_MODEL_VERSION}"
    if not target.is_dir():
        _build_atomically(target, build_demo_model)
    if name == DEMO_PIPELINE_MODEL_ID:
        source = target
        target = cache_dir() / "models" / f"{DEMO_PIPELINE_MODEL_ID}-{DEMO_MODEL_VERSION}"
        if not target.is_dir():
            _build_atomically(target, lambda path: build_qwen2_variant(source, path))
    elif name == DEMO_DEEP_MODEL_ID:
        source = target
        target = cache_dir() / "models" / f"{DEMO_DEEP_MODEL_ID}-{DEMO_MODEL_VERSION}"
        if not target.is_dir():
            _build_atomically(target, lambda path: build_deep_variant(source, path))
    elif name == DEMO_DRAFT_MODEL_ID:
        source = target
        target = cache_dir() / "models" / f"{DEMO_DRAFT_MODEL_ID}-{DEMO_MODEL_VERSION}"
        if not target.is_dir():
            _build_atomically(target, lambda path: build_draft_variant(source, path))
    elif name == DEMO_LONG_MODEL_ID:
        source = target
        target = cache_dir() / "models" / f"{DEMO_LONG_MODEL_ID}-{DEMO_MODEL_VERSION}"
        if not target.is_dir():
            _build_atomically(target, lambda path: build_long_variant(source, path))
    return str(target)


def _build_atomically(target: Path, build: Callable[[Path], None]) -> None:
    """Build into a private temporary directory, then rename it into place.

    A directory rename is atomic, so a reader never sees a half-built model; when two
    processes race, the loser's rename fails because the target exists, and it keeps the
    winner's copy (both are identical).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(staging)
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def build_demo_model(path: Path) -> None:
    """Write the demo model (config, weights, tokenizer) into `path`, created if missing.

    The output depends on nothing but this module and the installed mlx version. It reseeds the
    calling thread's MLX generator. Called off the main thread, that thread must run
    `mx.clear_streams()` before it ends (MLX 0.32 aborts at exit otherwise).
    """
    import mlx.core as mx

    from runner import demo_shaping

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(path)
    base_config = {
        **BASE_CONFIG,
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "bos_token_id": tokenizer.token_to_id(ENDOFTEXT),
        "eos_token_id": tokenizer.token_to_id(IM_END),
    }
    texts = [
        tokenizer.decode([i], skip_special_tokens=False) for i in range(base_config["vocab_size"])
    ]
    silent = silent_token_ids(tokenizer, _MARKERS)
    silent += demo_shaping.mode_tokens(texts) + demo_shaping.whitespace_tokens(texts)
    base = _base_weights(base_config, sorted(set(silent)))
    conversations = [
        (TOOL_DEMO_TOOLS, TOOL_DEMO_MESSAGES, TOOL_DEMO_CALLS),
        (TOOL_DEMO_TOOLS, TOOL_DEMO_PARALLEL_MESSAGES, TOOL_DEMO_PARALLEL_CALLS),
    ]
    weights = demo_shaping.shape(base, base_config, path, conversations)
    config = demo_shaping.config(base_config)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    mx.eval(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})


def build_long_variant(source: Path, path: Path) -> None:
    """Write the demo model at `source` into `path` with a `LONG_CONTEXT`-token context."""
    shutil.copytree(source, path, dirs_exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    config["max_position_embeddings"] = LONG_CONTEXT
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def build_deep_variant(source: Path, path: Path) -> None:
    """Write `DEMO_DEEP_MODEL_ID` into `path`: the demo model at `source` with layers added
    after its own up to `DEEP_LAYERS`, each a copy of its last layer whose attention and MLP
    output projections are zero, so that it adds nothing and the logits are the same."""
    import mlx.core as mx

    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    weights = mx.load(str(source / "model.safetensors"))
    assert isinstance(weights, dict)
    own = config["num_hidden_layers"]
    last = f"model.layers.{own - 1}."
    for layer in range(own, DEEP_LAYERS):
        for name, weight in list(weights.items()):
            if name.startswith(last):
                copied = f"model.layers.{layer}." + name[len(last) :]
                silent = name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight"))
                weights[copied] = mx.zeros_like(weight) if silent else weight
    config["num_hidden_layers"] = DEEP_LAYERS
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(source / name, path / name)


def build_draft_variant(source: Path, path: Path) -> None:
    """Write `DEMO_DRAFT_MODEL_ID` into `path`: the tokenizer of the demo model at `source`,
    one Llama layer of other random weights (seeded), its logits as peaked."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = 1
    args = llama.ModelArgs.from_dict(config)  # type: ignore[no-untyped-call]  # unannotated
    mx.random.seed(1)  # not the demo model's 0
    model = llama.Model(args)
    model.model.norm.weight = model.model.norm.weight * _LOGIT_SCALE
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(source / name, path / name)


def build_qwen2_variant(source: Path, path: Path) -> None:
    """Write the demo model at `source` into `path` in Qwen2's layout: the same weights, plus
    the q/k/v biases Qwen2 has, all zero, so it computes the same logits. The weight index
    file is there because mlx-lm's pipeline loading reads it to pick each stage's files."""
    import mlx.core as mx

    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    if config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]:
        raise ValueError("Qwen2 derives head_dim from hidden_size: the layouts differ")
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    del config["head_dim"]
    weights = mx.load(str(source / "model.safetensors"))
    assert isinstance(weights, dict)
    for layer in range(config["num_hidden_layers"]):
        for proj in ("q_proj", "k_proj", "v_proj"):
            weight = weights[f"model.layers.{layer}.self_attn.{proj}.weight"]
            bias = mx.zeros((weight.shape[0],), dtype=weight.dtype)
            weights[f"model.layers.{layer}.self_attn.{proj}.bias"] = bias
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = {"metadata": {}, "weight_map": dict.fromkeys(sorted(weights), "model.safetensors")}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(source / name, path / name)


def _build_tokenizer(path: Path) -> Tokenizer:
    """Train the BPE and write tokenizer.json and tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE - len(_ADDED),
        special_tokens=list(_SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(CORPUS), trainer=trainer)
    tokenizer.add_tokens([AddedToken(marker, special=False, normalized=False) for marker in _ADDED])
    tokenizer.save(str(path / "tokenizer.json"))

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": ENDOFTEXT,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n"
    )
    return tokenizer


def _base_weights(config: dict[str, Any], silent_ids: list[int]) -> dict[str, Any]:
    """The random model that writes the nonsense (mlx-lm's Llama weights, by name)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    args = llama.ModelArgs.from_dict(config)  # type: ignore[no-untyped-call]  # unannotated
    # Module init draws from MLX's generator, which is per thread: this reseeds the caller's.
    mx.random.seed(0)
    model = llama.Model(args)
    # A zero row gives logit 0 while the best others reach about +15: practically never chosen
    # unaided, yet a logit bias still reaches it.
    keep = mx.ones((config["vocab_size"], 1), dtype=mx.float32)
    keep[mx.array(silent_ids)] = 0.0
    model.lm_head.weight = model.lm_head.weight * keep
    model.model.norm.weight = model.model.norm.weight * _LOGIT_SCALE
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    return weights
