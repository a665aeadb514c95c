"""LoRA adapters (runner.adapter) on the built-in model, loaded by `MlxModel.load` as served
ids MODEL:ADAPTER; and the runner's chat template arguments under a request's."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.frames import Generate, Message
from runner import adapter
from runner.engine.kv_store import model_identity
from runner.engine.mlx_model import MlxModel
from runner.errors import AdapterError
from runner.model_options import ModelOptions
from runner.model_source import HubSource
from tests.adapters import make_adapter
from tests.fakehub import FakeHub, runner_against

MODEL = "orchard-demo"


@pytest.fixture(scope="module")
def lora(demo_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tmp_path_factory.mktemp("adapters") / "my-lora", demo_model_path)


@pytest.mark.parametrize(
    ("value", "hub"),
    [
        ("someone/my-lora", True),
        ("someone/my.lora-v2", True),
        ("./my-lora", False),
        ("../adapters/my-lora", False),
        ("/abs/my-lora", False),
        ("a/b/c", False),
        ("my-lora", False),
    ],
)
def test_a_hub_id_or_a_path(value: str, hub: bool) -> None:
    assert adapter.is_hub_id(value) is hub


def test_a_missing_directory_that_is_no_hub_id(tmp_path: Path) -> None:
    with pytest.raises(AdapterError) as info:
        adapter.locate(str(tmp_path / "nowhere"))
    assert str(info.value) == f"no adapter directory at {tmp_path / 'nowhere'}"


def test_the_model_loads_with_its_adapter_under_the_served_id(
    demo_model_path: Path, lora: Path
) -> None:
    options = ModelOptions(model=MODEL, adapter_path=str(lora))
    adapted = MlxModel.load(f"{MODEL}:my-lora", options=options)
    base = MlxModel.load(MODEL)
    assert adapted.name == f"{MODEL}:my-lora"
    assert (adapted.directory, adapted.adapter_directory) == (str(demo_model_path), str(lora))
    assert base.adapter_directory is None
    # The adapter's layers are on the model, and change what it computes.
    names = [name for name, _ in adapted.model.named_modules()]
    assert "model.layers.3.self_attn.q_proj" in names
    assert any(name.endswith("q_proj.linear") for name in names)
    assert not any(name.endswith("q_proj.linear") for name, _ in base.model.named_modules())
    import mlx.core as mx

    tokens = mx.array([[1, 2, 3, 4]])
    assert not mx.allclose(adapted.model(tokens), base.model(tokens)).item()


def test_the_shelf_fetches_a_served_id_as_its_model(demo_model_path: Path) -> None:
    source = HubSource({f"{MODEL}:my-lora": MODEL})
    assert source.on_disk(f"{MODEL}:my-lora") == str(demo_model_path)
    assert source.fetch(f"{MODEL}:my-lora", lambda done, total: None) == str(demo_model_path)


def test_the_disk_cache_of_an_adapted_model_is_its_own(demo_model_path: Path, lora: Path) -> None:
    # As MlxEngine keys it: the served id and the model's files, then the adapter's files.
    served = model_identity(f"{MODEL}:my-lora", demo_model_path)
    adapted = model_identity(served, lora)
    assert adapted != served
    assert adapted != model_identity(MODEL, demo_model_path)
    assert model_identity(served, lora) == adapted  # stable across restarts


def test_a_hub_adapter_that_is_not_there_is_one_clear_line(tmp_path: Path) -> None:
    # A Hub id is checked when it downloads, as its model loads (here: at start).
    with FakeHub() as hub:
        proc = runner_against(hub, tmp_path, "--adapter-path", "orchard-test/nope")
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.endswith(
        f"runner: could not load {MODEL}:nope: orchard-test/nope was not found on {hub.url}: "
        "check the name (organization/model). If it is private or gated, set HF_TOKEN to an "
        "access token that can read it (and accept its license on the model's page)."
    ), line


def prompt_of(model: MlxModel, **fields: object) -> list[int]:
    generate = Generate("r", MODEL, (Message("user", "Hello"),), max_tokens=1, **fields)  # type: ignore[arg-type]
    [request] = model.prepare_choices(generate, 0.0)
    return request.prompt


def test_the_runner_template_arguments_yield_to_the_request(demo_model_path: Path) -> None:
    plain = MlxModel.load(MODEL)
    thinking, not_thinking = prompt_of(plain), prompt_of(plain, reasoning_effort="none")
    assert thinking != not_thinking
    quiet = MlxModel.load(
        MODEL, options=ModelOptions(chat_template_args={"enable_thinking": False})
    )
    assert prompt_of(quiet) == not_thinking
    assert prompt_of(quiet, reasoning_effort="high") == thinking
    assert prompt_of(quiet, chat_template_kwargs='{"enable_thinking": true}') == thinking
    assert prompt_of(quiet, chat_template_kwargs='{"other": 1}') == not_thinking
