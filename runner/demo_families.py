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

`build_family_model` writes one into a directory (`runner.demo_family_build` builds it);
`runner.demo_model.resolve_model` builds each into the cache on first use (`family_of` maps a
served id to its family).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from runner.demo_corpus import CONTEXT_LENGTH
from runner.demo_family_build import Family, base_config, build, chat_template

FAMILY_MODEL_VERSION = "v1"
"""Part of each family model's cache directory name: bump it whenever the built files change."""


def build_family_model(family: str, path: Path) -> None:
    """Write `family`'s demo model (config, weights, tokenizer) into `path`, created if missing
    (`runner.demo_family_build.build`)."""
    build(FAMILIES[family], path)


def family_of(model_id: str) -> str | None:
    """The family served as `model_id`, or None when it is no family's demo model."""
    return _BY_MODEL_ID.get(model_id)


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
        config=base_config(
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
        chat_template=chat_template("harmony"),
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
        config=base_config(
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
        chat_template=chat_template("qwen3-coder"),
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
        config=base_config(
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
        chat_template=chat_template("mistral"),
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
        config=base_config(
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
        chat_template=chat_template("glm47"),
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
        config=base_config(
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
        chat_template=chat_template("kimi"),
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
        config=base_config(
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
        chat_template=chat_template("minimax"),
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
        config=base_config(
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
        chat_template=chat_template("lfm2"),
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
        config=base_config(
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
        chat_template=chat_template("gemma4"),
        head="model.embed_tokens.weight",
        final_norm="model.norm.weight",
        # Gemma normalises each branch's output: its norms set the branches' weight.
        branch_outputs=("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"),
        branch_gain=8.0,
    ),
}
"""The families, by name (`orchard demo-model --family NAME`)."""

_BY_MODEL_ID = {spec.model_id: name for name, spec in FAMILIES.items()}
