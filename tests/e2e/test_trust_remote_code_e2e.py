"""`orchard runner --trust-remote-code`: a model whose tokenizer is code in its own directory
(`auto_map`, as Hub repositories ship it) loads with the flag and answers through the gateway
as the built-in model does; without it the load is refused, never prompting."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from runner.engine.mlx_model import MlxModel
from runner.model_options import ModelOptions
from tests.support import SHARED_MODEL, Gateway, Process, Stacks, gateway_with_runner

TOKENIZER_CODE = '''from transformers import PreTrainedTokenizerFast


class OrchardTokenizer(PreTrainedTokenizerFast):
    """The built-in tokenizer, loaded as the model's own code."""
'''


@pytest.fixture(scope="module")
def remote_code_model(demo_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in model, its tokenizer class in a module of its directory."""
    path = tmp_path_factory.mktemp("remote-code") / "orchard-remote-code"
    shutil.copytree(demo_model_path, path)
    (path / "tokenization_orchard.py").write_text(TOKENIZER_CODE)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_orchard.OrchardTokenizer"]}
    config["tokenizer_class"] = "OrchardTokenizer"
    config_path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def trusting(remote_code_model: Path) -> Iterator[tuple[Gateway, Process]]:
    with gateway_with_runner("--model", str(remote_code_model), "--trust-remote-code") as stack:
        yield stack


def test_without_the_flag_the_load_is_refused(remote_code_model: Path) -> None:
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        MlxModel.load(str(remote_code_model), options=ModelOptions())
    loaded = MlxModel.load(str(remote_code_model), options=ModelOptions(trust_remote_code=True))
    assert type(loaded.tokenizer._tokenizer).__name__ == "OrchardTokenizer"


def test_with_the_flag_it_answers_as_the_built_in_model(
    trusting: tuple[Gateway, Process], remote_code_model: Path, stacks: Stacks
) -> None:
    plain, _ = stacks.get("mlx-batched")
    answers = []
    for base, model in ((plain.base, SHARED_MODEL), (trusting[0].base, str(remote_code_model))):
        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as client:
            done = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Tell me about apples."}],
                max_tokens=24,
                temperature=0,
            )
        assert done.usage is not None
        answers.append(
            (
                done.choices[0].message.content,
                done.usage.prompt_tokens,
                done.usage.completion_tokens,
            )
        )
    assert answers[0][2] > 0
    assert answers[1] == answers[0]
