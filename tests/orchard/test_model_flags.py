"""`orchard runner`'s model options (mlx_lm.server's): each bad value, and each broken LoRA
adapter, is a usage error (exit 2) naming the option, before the runner connects; a model with
an adapter is served as MODEL:ADAPTER."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchard import cli
from orchard.model_flags import options_of
from runner.model_options import (
    ModelOptions,
    OptionError,
    head_width,
    kv_group_problem,
    model_options,
    served_id,
)
from tests.adapters import make_adapter
from tests.support import orchard_command

UNREACHABLE = ("--gateway", "http://127.0.0.1:9")
"""No gateway listens there: each case must end before connecting."""


def runner_error(*flags: str) -> str:
    """The last line `orchard runner` prints with `flags`, which must exit 2."""
    result = CliRunner().invoke(cli.main, ["runner", *UNREACHABLE, *flags])
    assert result.exit_code == 2, result.output
    line: str = result.output.splitlines()[-1]
    return line


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (("--kv-bits", "3"), "Invalid value for --kv-bits: must be 4 or 8, not 3"),
        (
            ("--kv-group-size", "7"),
            "Invalid value for --kv-group-size: must be 32, 64 or 128, not 7",
        ),
        (("--num-draft-tokens", "0"), "Invalid value for --num-draft-tokens: must be at least 1"),
        (("--temp", "5"), "Invalid value for --temp: must be between 0 and 2"),
        (
            ("--chat-template-args", "{enable_thinking: false}"),
            "Invalid value for --chat-template-args: not JSON: Expecting property name "
            "enclosed in double quotes: line 1 column 2 (char 1)",
        ),
        (
            ("--chat-template-args", "[1, 2]"),
            "Invalid value for --chat-template-args: must be a JSON object",
        ),
        (
            ("--chat-template-args", '{"messages": []}'),
            "Invalid value for --chat-template-args: may not set 'messages'",
        ),
        (
            ("--chat-template", "no-such-template.jinja"),
            "Invalid value for --chat-template: no template file at no-such-template.jinja "
            "(nor is it a template's text: that holds {{ or {%)",
        ),
        (
            ("--chat-template-args", 'other-model={"a": 1}'),
            "Invalid value for --chat-template-args: 'other-model' is not one of the --model "
            "values (orchard-demo); give VALUE for every model or MODEL=VALUE",
        ),
        (
            ("--adapter-path", "other-model=/tmp/my-lora"),
            "Invalid value for --adapter-path: 'other-model' is not one of the --model values "
            "(orchard-demo); give VALUE for every model or MODEL=VALUE",
        ),
        (
            (
                "--adapter-path",
                "orchard-demo=a/my-lora",
                "--adapter-path",
                "orchard-demo=b/my-lora",
            ),
            "Invalid value for --adapter-path: orchard-demo:my-lora is served twice: two "
            "adapters of one model need different directory names",
        ),
        (
            ("--adapter-path", "./adapters/nowhere"),
            "Invalid value for --adapter-path: orchard-demo:nowhere: no adapter directory at "
            "./adapters/nowhere",
        ),
    ],
)
def test_a_bad_value_is_a_usage_error(flags: tuple[str, ...], error: str) -> None:
    assert runner_error(*flags) == f"Error: {error}"


def test_a_draft_that_tokenizes_otherwise_is_refused(demo_model_path: Path) -> None:
    line = runner_error("--draft-model", "orchard-demo-harmony")
    assert line.startswith(
        "Error: Invalid value for --draft-model: orchard-demo-harmony does not tokenize as "
        "orchard-demo: "
    )
    assert line.endswith(
        " tokens have other ids (e.g. '!'); a draft model must share its model's tokenizer"
    )
    assert runner_error("--draft-model", "./drafts/nowhere") == (
        "Error: Invalid value for --draft-model: no model at ./drafts/nowhere"
    )


@pytest.mark.parametrize(
    "flags", [("--temp", "0.5"), ("--draft-model", "orchard-demo"), ("--kv-bits", "8")]
)
def test_the_scripted_engine_refuses_every_model_option(flags: tuple[str, ...]) -> None:
    assert runner_error("--engine", "scripted", *flags) == (
        "Error: Invalid value for --engine: the scripted engine takes no draft model, KV "
        "quantization, adapter, chat template, remote code or sampling defaults (--temp, "
        "--top-p, --top-k, --min-p, --max-tokens)"
    )


@pytest.fixture(scope="module")
def adapter(demo_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tmp_path_factory.mktemp("adapters") / "my-lora", demo_model_path)


def broken(adapter: Path, tmp_path: Path, name: str = "broken") -> Path:
    copy = tmp_path / name
    shutil.copytree(adapter, copy)
    return copy


def test_an_adapter_without_its_config(adapter: Path, tmp_path: Path) -> None:
    bad = broken(adapter, tmp_path)
    (bad / "adapter_config.json").unlink()
    assert runner_error("--adapter-path", str(bad)) == (
        f"Error: Invalid value for --adapter-path: orchard-demo:broken: no adapter_config.json "
        f"in {bad}: an mlx-lm adapter directory holds adapter_config.json and "
        "adapters.safetensors, as mlx_lm.lora writes them"
    )


def test_an_adapter_whose_config_is_not_json(adapter: Path, tmp_path: Path) -> None:
    bad = broken(adapter, tmp_path)
    (bad / "adapter_config.json").write_text("{'rank': 4}")
    assert runner_error("--adapter-path", str(bad)) == (
        "Error: Invalid value for --adapter-path: orchard-demo:broken: "
        f"{bad / 'adapter_config.json'} is not JSON: Expecting property name enclosed in "
        "double quotes: line 1 column 2 (char 1)"
    )


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"fine_tune_type": "qlora"}, "fine_tune_type is 'qlora', not one of lora, dora, full"),
        ({"num_layers": "2"}, "num_layers must be a whole number, not '2'"),
        (
            {"lora_parameters": {"rank": 4, "alpha": 16, "dropout": 0.0}},
            "lora_parameters has no scale (mlx-lm's scale, not alpha)",
        ),
        (
            {"lora_parameters": {"rank": 0, "scale": 10.0, "dropout": 0.0}},
            "lora_parameters' rank must be at least 1",
        ),
    ],
)
def test_an_adapter_config_mlx_lm_cannot_read(
    adapter: Path, tmp_path: Path, change: dict[str, object], error: str
) -> None:
    bad = broken(adapter, tmp_path)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, **change}))
    assert runner_error("--adapter-path", str(bad)) == (
        "Error: Invalid value for --adapter-path: orchard-demo:broken: "
        f"{bad / 'adapter_config.json'}: {error}"
    )


def test_an_adapter_without_weights(adapter: Path, tmp_path: Path) -> None:
    bad = broken(adapter, tmp_path)
    (bad / "adapters.safetensors").unlink()
    assert runner_error("--adapter-path", str(bad)) == (
        "Error: Invalid value for --adapter-path: orchard-demo:broken: no adapters.safetensors "
        f"in {bad}: the adapter has no weights"
    )


def test_an_adapter_whose_weights_are_no_safetensors(adapter: Path, tmp_path: Path) -> None:
    bad = broken(adapter, tmp_path)
    (bad / "adapters.safetensors").write_bytes(b"not weights")
    assert runner_error("--adapter-path", str(bad)) == (
        "Error: Invalid value for --adapter-path: orchard-demo:broken: "
        f"{bad / 'adapters.safetensors'} is not a safetensors file: no safetensors header"
    )


def test_an_adapter_that_does_not_fit_the_model_is_refused_by_the_real_command(
    adapter: Path, tmp_path: Path
) -> None:
    # Its config says rank 8, its weights are rank 4: mlx-lm's LoRA layers do not take them.
    bad = broken(adapter, tmp_path, "misfit")
    config = json.loads((bad / "adapter_config.json").read_text())
    config["lora_parameters"]["rank"] = 8
    (bad / "adapter_config.json").write_text(json.dumps(config))
    proc = orchard_command(
        "runner", *UNREACHABLE, *("--adapter-path", str(bad), "--log-level", "warning")
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "Error: Invalid value for --adapter-path: orchard-demo:misfit: the adapter at "
        f"{bad} does not fit orchard-demo: model.layers.3.self_attn.q_proj.lora_a: adapter "
        "shape (96, 4) does not match model parameter shape (96, 8) (and 27 more)"
    )
    assert "Traceback" not in proc.stderr


def test_the_adapter_names_the_served_model() -> None:
    assert served_id("orchard-demo", None) == "orchard-demo"
    assert served_id("orchard-demo", "./adapters/my-lora/") == "orchard-demo:my-lora"
    assert served_id("mlx-community/Qwen3-4B", "someone/qwen3-poems") == (
        "mlx-community/Qwen3-4B:qwen3-poems"
    )


def test_several_models_each_with_their_adapters_or_none() -> None:
    options = model_options(
        ("orchard-demo", "other"),
        adapter_path=("orchard-demo=", "orchard-demo=a/lora-a", "orchard-demo=org/lora-b"),
        chat_template_args=('{"x": 1}', 'orchard-demo:lora-a={"x": 2}'),
    )
    assert options == {
        "orchard-demo": ModelOptions(chat_template_args={"x": 1}),
        "orchard-demo:lora-a": ModelOptions(
            model="orchard-demo", adapter_path="a/lora-a", chat_template_args={"x": 2}
        ),
        "orchard-demo:lora-b": ModelOptions(
            model="orchard-demo", adapter_path="org/lora-b", chat_template_args={"x": 1}
        ),
        "other": ModelOptions(chat_template_args={"x": 1}),
    }
    assert options["orchard-demo:lora-a"].base("orchard-demo:lora-a") == "orchard-demo"
    assert options["other"].base("other") == "other"


def test_an_adapter_for_every_model_and_one_model_without() -> None:
    options = model_options(("a", "b", "c"), adapter_path=("x/lora", "b="))
    assert {served: o.adapter_path for served, o in options.items()} == {
        "a:lora": "x/lora",
        "b": None,
        "c:lora": "x/lora",
    }


def test_a_template_file_or_text_and_its_arguments(tmp_path: Path) -> None:
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    values = {
        "draft_model": (),
        "num_draft_tokens": 3,
        "kv_bits": None,
        "kv_group_size": 64,
        "quantized_kv_start": 5000,
        "adapter_path": (),
        "chat_template": (str(template), "b={{ messages[0].content }}"),
        "chat_template_args": ('a={"greeting": "hi"}',),
        "trust_remote_code": False,
        "temp": None,
        "top_p": None,
        "top_k": None,
        "min_p": None,
        "default_max_tokens": None,
    }
    options = options_of(("a", "b"), values)
    assert options["a"].chat_template == template.read_text()
    assert options["b"].chat_template == "{{ messages[0].content }}"
    assert (options["a"].chat_template_args, options["b"].chat_template_args) == (
        {"greeting": "hi"},
        {},
    )


def test_model_options_raise_option_errors() -> None:
    with pytest.raises(OptionError, match="must be 4 or 8") as info:
        model_options(("a",), kv_bits=2)
    assert info.value.option == "--kv-bits"


def test_kv_bits_on_heads_no_group_divides_is_refused(demo_model_path: Path) -> None:
    # The built-in model's heads are 16 values wide: mx.quantize takes groups of 32 at least.
    assert runner_error("--kv-bits", "8") == (
        "Error: Invalid value for --kv-bits: orchard-demo's attention heads are 16 values "
        "wide: no group size (32, 64, 128) divides them, so its KV cache cannot be quantized; "
        "leave out --kv-bits"
    )


def test_the_kv_group_must_divide_the_heads() -> None:
    wide = ModelOptions(kv_bits=8, kv_group_size=128)
    assert head_width({"hidden_size": 256, "num_attention_heads": 4}) == 64
    assert head_width({"text_config": {"head_dim": 96}}) == 96
    assert head_width({"hidden_size": 256}) is None
    assert kv_group_problem("m", 64, wide) == (
        "m's attention heads are 64 values wide: --kv-group-size 128 does not divide them "
        "(use 32 or 64)"
    )
    assert kv_group_problem("m", 128, wide) is None
