"""One tiny random-weight model per model family, so that each family's tool calls, think
markers and chat template run through mlx-lm exactly as the real models do, with no download.

`FAMILIES` names them: the served id (`orchard-demo-<family>`), the mlx-lm architecture, the
tool parser and the think markers mlx-lm detects. Each is built as `runner.demo_model`'s
built-in model is (read that module first), and differs where the family does:

- the architecture is the family's own mlx-lm model class, tiny (64 wide, 2 layers, 4 heads;
  MoE families with 4 experts, 2 per token), initialised after `mx.random.seed(0)`; the output
  rows of the family's marker tokens and of non-text byte tokens are zero and the final norm is
  scaled up (as in the built-in model), so free greedy decoding writes nonsense without markup.
  With tied embeddings (LFM2, Gemma 4) the zero rows are the markers' input embeddings too,
  and the layers' residual branches are scaled up, else the model repeats its last token;
- the tokenizer is the built-in model's byte-level BPE, trained on the same corpus to leave
  room for the family's special tokens, each one token under the name the real model uses;
- the chat template is written here to the family's published template: compact, but it
  renders the same text for the same conversation (tools, tool calls, tool results, thinking).
  It is what mlx-lm's `TokenizerWrapper` inspects to pick the tool parser, so mlx-lm treats
  it as it treats the real model. Where the real template would fail or is unstable (a tool
  call's arguments given as a JSON string, today's date in the system prompt), it renders the
  arguments as given and leaves the date out;
- no shaping: these models never call tools by themselves (the built-in model does).

`build_family_model` writes one into a directory; `runner.demo_model.resolve_model` builds
each into the cache on first use (`family_of` maps a served id to its family).
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from runner.demo_family_templates import (
    GEMMA4_TEMPLATE,
    GLM47_TEMPLATE,
    HARMONY_TEMPLATE,
    KIMI_TEMPLATE,
    LFM2_TEMPLATE,
    MINIMAX_TEMPLATE,
    MISTRAL_TEMPLATE,
    QWEN3_CODER_TEMPLATE,
)
from runner.demo_model import _CORPUS, CONTEXT_LENGTH, silent_token_ids

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# mlx, mlx-lm and tokenizers are imported where a model is built (PLC0415): `orchard
# demo-model --help` lists the families and must start fast.

FAMILY_MODEL_VERSION = "v1"
"""Part of each family model's cache directory name: bump it whenever the built files change."""

_VOCAB_SIZE = 1024
_LOGIT_SCALE = 10.0
_SEED = 0


@attrs.frozen
class Family:
    """One model family's demo model: what it is and what mlx-lm makes of it."""

    model_id: str
    """The served id, `orchard-demo-<family>`."""
    stands_for: str
    """The real model whose format it has."""
    architecture: str
    """The mlx-lm module that runs it (`mlx_lm.models.<architecture>`)."""
    model_type: str
    """Its config's `model_type` (mlx-lm maps some onto another architecture)."""
    tool_parser: str | None
    """The parser mlx-lm picks (`mlx_lm.tool_parsers.<name>`); None where it has none."""
    think: tuple[str, str] | None
    """The think markers mlx-lm detects, or None."""
    notes: str
    """How it differs from the real family, and why."""
    special_tokens: tuple[str, ...]
    """Single tokens, special (decoding with `skip_special_tokens` drops them)."""
    added_tokens: tuple[str, ...]
    """Single tokens that decode as text, as in the real tokenizer."""
    bos: str | None
    """The tokenizer's `bos_token`."""
    eos: str
    """The tokenizer's `eos_token`."""
    stops: tuple[str, ...]
    """The tokens that end a generation: `eos_token_id` in config.json and
    generation_config.json (mlx-lm stops at these and at `eos`)."""
    pad: str | None
    config: Mapping[str, Any]
    """config.json, less the ids the tokenizer decides (vocab size, bos, eos)."""
    chat_template: str
    head: str
    """The weight whose rows are the logits: the output head or, tied, the embeddings."""
    final_norm: str
    branch_outputs: tuple[str, ...] = ()
    """Weights (by name suffix) that end each layer's residual branches, scaled by
    `branch_gain`: with tied embeddings a random model repeats its last token, unless the
    layers outweigh the embedding in the residual stream."""
    branch_gain: float = 1.0


def build_family_model(family: str, path: Path) -> None:
    """Write `family`'s demo model (config, weights, tokenizer) into `path`, created if missing.

    It depends only on this module, `runner.demo_model`'s corpus and the installed mlx and
    mlx-lm; it takes well under a second. It reseeds the calling thread's MLX generator (off
    the main thread, see `runner.demo_model.build_demo_model`).
    """
    import mlx.core as mx  # noqa: PLC0415

    spec = FAMILIES[family]
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(spec, path)
    config = _config(spec, tokenizer)
    for name in ("config.json", "generation_config.json"):
        content = config if name == "config.json" else {"eos_token_id": config["eos_token_id"]}
        (path / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    markers = set(spec.special_tokens + spec.added_tokens)
    weights = _weights(spec, config, silent_token_ids(tokenizer, markers))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})


def family_of(model_id: str) -> str | None:
    """The family served as `model_id`, or None when it is no family's demo model."""
    return _BY_MODEL_ID.get(model_id)


def _config(spec: Family, tokenizer: Tokenizer) -> dict[str, Any]:
    ids = {
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "eos_token_id": [tokenizer.token_to_id(token) for token in spec.stops],
    }
    if spec.bos is not None:
        ids["bos_token_id"] = tokenizer.token_to_id(spec.bos)
    config = {**spec.config, **ids}
    if "text_config" in config:  # Mistral 3's layout: the language model's own config
        config["text_config"] = {**config["text_config"], "vocab_size": ids["vocab_size"]}
    return config


@functools.cache
def _trained_bpe(vocab_size: int) -> str:
    """The corpus's byte-level BPE with `vocab_size` tokens, as tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(_CORPUS), trainer=trainer)
    return str(tokenizer.to_str())


def _build_tokenizer(spec: Family, path: Path) -> Tokenizer:
    """Train the BPE, add the family's tokens, write tokenizer.json and tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer  # noqa: PLC0415

    markers = spec.special_tokens + spec.added_tokens
    tokenizer = Tokenizer.from_str(_trained_bpe(_VOCAB_SIZE - len(markers)))
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in spec.special_tokens]
    )
    tokenizer.add_tokens(
        [AddedToken(token, special=False, normalized=False) for token in spec.added_tokens]
    )
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos,
        "eos_token": spec.eos,
        "pad_token": spec.pad,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": spec.chat_template,
    }
    (path / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n"
    )
    return tokenizer


def _weights(spec: Family, config: dict[str, Any], silent_ids: list[int]) -> dict[str, Any]:
    """The random model, by weight name, with its markers silenced and its logits peaked."""
    import mlx.core as mx  # noqa: PLC0415
    from mlx.utils import tree_flatten  # noqa: PLC0415

    module = importlib.import_module(f"mlx_lm.models.{spec.architecture}")
    args = module.ModelArgs.from_dict(config)
    # Module init draws from MLX's generator, which is per thread: this reseeds the caller's.
    mx.random.seed(_SEED)
    weights = dict(tree_flatten(module.Model(args).parameters()))
    keep = mx.ones((config["vocab_size"], 1), dtype=mx.float32)
    keep[mx.array(silent_ids)] = 0.0
    weights[spec.head] = weights[spec.head] * keep
    weights[spec.final_norm] = weights[spec.final_norm] * _LOGIT_SCALE
    for name, weight in weights.items():
        if name.endswith(spec.branch_outputs):
            weights[name] = weight * spec.branch_gain
    mx.eval(weights)
    return weights


def _base_config(**fields: Any) -> dict[str, Any]:
    return {
        "max_position_embeddings": CONTEXT_LENGTH,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **fields,
    }


FAMILIES: Mapping[str, Family] = {
    "harmony": Family(
        model_id="orchard-demo-harmony",
        stands_for="gpt-oss",
        architecture="gpt_oss",
        model_type="gpt_oss",
        tool_parser=None,
        think=None,
        notes=(
            "mlx-lm has no Harmony parser and detects no think markers: the channels are for "
            "runner.harmony. Tool results are rendered as given, as openai-harmony renders them "
            "(the HF template JSON-quotes them); every call of a message is rendered (the HF "
            "template renders the first); no current date unless current_date is given; RoPE "
            "without YaRN."
        ),
        special_tokens=(
            "<|startoftext|>",
            "<|endoftext|>",
            "<|return|>",
            "<|constrain|>",
            "<|channel|>",
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|call|>",
        ),
        added_tokens=(),
        bos="<|startoftext|>",
        eos="<|return|>",
        stops=("<|return|>", "<|endoftext|>", "<|call|>"),
        pad="<|endoftext|>",
        config=_base_config(
            model_type="gpt_oss",
            architectures=["GptOssForCausalLM"],
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"],
            rms_norm_eps=1e-5,
            rope_theta=150000,
            # gpt-oss scales with YaRN from 4,096 tokens; this context is shorter.
            rope_scaling={"rope_type": "default"},
        ),
        chat_template=HARMONY_TEMPLATE,
        head="lm_head.weight",
        final_norm="model.norm.weight",
    ),
    "qwen3-coder": Family(
        model_id="orchard-demo-qwen3-coder",
        stands_for="Qwen3-Coder-30B-A3B-Instruct",
        architecture="qwen3_moe",
        model_type="qwen3_moe",
        tool_parser="qwen3_coder",
        think=("<think>", "</think>"),
        notes=(
            "Its template never thinks, but its vocabulary (Qwen3's) has <think> and </think>, so "
            "mlx-lm detects think markers, as it does for the real model."
        ),
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        added_tokens=(
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
            "<think>",
            "</think>",
        ),
        bos=None,
        eos="<|im_end|>",
        stops=("<|im_end|>", "<|endoftext|>"),
        pad="<|endoftext|>",
        config=_base_config(
            model_type="qwen3_moe",
            architectures=["Qwen3MoeForCausalLM"],
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            rms_norm_eps=1e-6,
            rope_theta=10_000_000.0,
        ),
        chat_template=QWEN3_CODER_TEMPLATE,
        head="lm_head.weight",
        final_norm="model.norm.weight",
    ),
    "mistral": Family(
        model_id="orchard-demo-mistral",
        stands_for="Devstral Small 2",
        architecture="mistral3",
        model_type="mistral3",
        tool_parser="mistral",
        think=None,
        notes=(
            "The Mistral 3 layout around a Ministral 3 language model, as Devstral Small 2 ships. "
            "No default system prompt (the real one holds today's date). mlx-lm does not detect "
            "Magistral's [THINK] and [/THINK], so they are left out. The real tokenizer is tekken."
        ),
        special_tokens=(
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
            "[TOOL_CALLS]",
            "[SYSTEM_PROMPT]",
            "[/SYSTEM_PROMPT]",
            "[ARGS]",
        ),
        added_tokens=(),
        bos="<s>",
        eos="</s>",
        stops=("</s>",),
        pad=None,
        config=_base_config(
            model_type="mistral3",
            architectures=["Mistral3ForConditionalGeneration"],
            text_config={
                "model_type": "ministral3",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "rms_norm_eps": 1e-5,
                "max_position_embeddings": CONTEXT_LENGTH,
                "tie_word_embeddings": False,
                # Devstral's YaRN, at a factor of 1: its context is the original one here.
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 1.0,
                    "original_max_position_embeddings": CONTEXT_LENGTH,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                    "llama_4_scaling_beta": 0.1,
                    "rope_theta": 100_000_000.0,
                },
            },
        ),
        chat_template=MISTRAL_TEMPLATE,
        head="language_model.lm_head.weight",
        final_norm="language_model.model.norm.weight",
    ),
    "glm47": Family(
        model_id="orchard-demo-glm47",
        stands_for="GLM-4.7",
        architecture="glm4_moe",
        model_type="glm4_moe",
        tool_parser="glm47",
        think=("<think>", "</think>"),
        notes=(
            "Thinking is on unless enable_thinking is false; earlier turns' reasoning is cleared "
            "unless clear_thinking is false, as in GLM-4.7's template."
        ),
        special_tokens=(
            "<|endoftext|>",
            "[gMASK]",
            "<sop>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|observation|>",
        ),
        added_tokens=(
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
            "<tool_response>",
            "</tool_response>",
        ),
        bos=None,
        eos="<|endoftext|>",
        stops=("<|endoftext|>", "<|user|>", "<|observation|>"),
        pad="<|endoftext|>",
        config=_base_config(
            model_type="glm4_moe",
            architectures=["Glm4MoeForCausalLM"],
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            use_qk_norm=False,
            attention_bias=True,
            partial_rotary_factor=0.5,
            rms_norm_eps=1e-5,
            rope_theta=1_000_000.0,
            rope_scaling=None,
        ),
        chat_template=GLM47_TEMPLATE,
        head="lm_head.weight",
        final_norm="model.norm.weight",
    ),
    "kimi": Family(
        model_id="orchard-demo-kimi",
        stands_for="Kimi-K2-Thinking",
        architecture="deepseek_v3",
        model_type="kimi_k2",
        tool_parser="kimi_k2",
        think=("<think>", "</think>"),
        notes=(
            "model_type kimi_k2, which mlx-lm runs as DeepSeek-V3 (MLA, MoE); no YaRN at this "
            "context. A call id not in Kimi's functions.NAME:N form is rendered in it (N its place "
            "in the message), so that the history parses. The real tokenizer is tiktoken-based "
            "remote code."
        ),
        special_tokens=(
            "[BOS]",
            "[EOS]",
            "<|im_end|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|im_system|>",
            "<|im_middle|>",
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
        ),
        added_tokens=("<think>", "</think>"),
        bos="[BOS]",
        eos="[EOS]",
        stops=("<|im_end|>",),
        pad=None,
        config=_base_config(
            model_type="kimi_k2",
            architectures=["DeepseekV3ForCausalLM"],
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.827,
            first_k_dense_replace=1,
            rms_norm_eps=1e-6,
            rope_theta=50_000.0,
        ),
        chat_template=KIMI_TEMPLATE,
        head="lm_head.weight",
        final_norm="model.norm.weight",
    ),
    "minimax": Family(
        model_id="orchard-demo-minimax",
        stands_for="MiniMax-M2",
        architecture="minimax",
        model_type="minimax_m2",
        tool_parser="minimax_m2",
        think=("<think>", "</think>"),
        notes=(
            "model_type minimax_m2, which mlx-lm runs as minimax. enable_thinking=false closes the "
            "generation prompt's think span, as MiniMax's later M2.x templates do."
        ),
        special_tokens=("]~!b[", "]~b]", "[e~[", "<minimax:tool_call>", "</minimax:tool_call>"),
        added_tokens=("<think>", "</think>"),
        bos="]~!b[",
        eos="[e~[",
        stops=("[e~[",),
        pad=None,
        config=_base_config(
            model_type="minimax_m2",
            architectures=["MiniMaxM2ForCausalLM"],
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rotary_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=0,
            scoring_func="sigmoid",
            use_qk_norm=True,
            rms_norm_eps=1e-6,
            rope_theta=5_000_000.0,
        ),
        chat_template=MINIMAX_TEMPLATE,
        head="lm_head.weight",
        final_norm="model.norm.weight",
    ),
    "lfm2": Family(
        model_id="orchard-demo-lfm2",
        stands_for="LFM2",
        architecture="lfm2",
        model_type="lfm2",
        tool_parser="pythonic",
        think=None,
        notes=(
            "One short-convolution and one attention layer; embeddings tied, as mlx-lm's LFM2 "
            "always is. LFM2's template renders no tool_calls (clients put the call text in the "
            "content); this one writes them as LFM2 writes calls, [name(key=value)] between the "
            "call markers, values in JSON."
        ),
        special_tokens=(
            "<|pad|>",
            "<|startoftext|>",
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|tool_list_start|>",
            "<|tool_list_end|>",
            "<|tool_call_start|>",
            "<|tool_call_end|>",
            "<|tool_response_start|>",
            "<|tool_response_end|>",
        ),
        added_tokens=(),
        bos="<|startoftext|>",
        eos="<|im_end|>",
        stops=("<|im_end|>",),
        pad="<|pad|>",
        config=_base_config(
            model_type="lfm2",
            architectures=["Lfm2ForCausalLM"],
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["conv", "full_attention"],
            conv_bias=False,
            conv_L_cache=3,
            block_dim=64,
            block_ff_dim=128,
            block_multiple_of=32,
            block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=True,
            norm_eps=1e-5,
            rope_theta=1_000_000.0,
            tie_word_embeddings=True,
        ),
        chat_template=LFM2_TEMPLATE,
        head="model.embed_tokens.weight",
        final_norm="model.embedding_norm.weight",
        branch_outputs=("out_proj.weight", "feed_forward.w2.weight"),
        branch_gain=4.0,
    ),
    "gemma4": Family(
        model_id="orchard-demo-gemma4",
        stands_for="Gemma 4",
        architecture="gemma4_text",
        model_type="gemma4_text",
        tool_parser="gemma4",
        think=("<|channel>thought", "<channel|>"),
        notes=(
            "The text model, as in the 31B (no per-layer inputs, no KV sharing), embeddings tied. "
            "mlx-lm's think markers span several tokens (<|channel>, then 'thought'). The real "
            "tokenizer is SentencePiece. <|tool_response>, which the template leaves open after a "
            "call, ends a generation too."
        ),
        special_tokens=(
            "<pad>",
            "<eos>",
            "<bos>",
            "<|turn>",
            "<turn|>",
            "<|think|>",
            "<|channel>",
            "<channel|>",
            "<|tool>",
            "<tool|>",
            "<|tool_call>",
            "<tool_call|>",
            "<|tool_response>",
            "<tool_response|>",
            '<|"|>',
        ),
        added_tokens=(),
        bos="<bos>",
        eos="<eos>",
        stops=("<eos>", "<turn|>", "<|tool_response>"),
        pad="<pad>",
        config=_base_config(
            model_type="gemma4_text",
            architectures=["Gemma4ForCausalLM"],
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            num_global_key_value_heads=1,
            head_dim=16,
            global_head_dim=32,
            num_kv_shared_layers=0,
            hidden_size_per_layer_input=0,
            use_double_wide_mlp=False,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=30.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
        chat_template=GEMMA4_TEMPLATE,
        head="model.embed_tokens.weight",
        final_norm="model.norm.weight",
        # Gemma normalises each branch's output: its norms set the branches' weight.
        branch_outputs=("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"),
        branch_gain=8.0,
    ),
}
"""The families, by name (`orchard demo-model --family NAME`)."""

_BY_MODEL_ID = {spec.model_id: name for name, spec in FAMILIES.items()}
