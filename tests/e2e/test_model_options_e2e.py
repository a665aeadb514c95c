"""mlx_lm.server's model options on a real runner, end to end with the `openai` SDK over real
sockets: LoRA adapters served as MODEL:ADAPTER beside their model (one from a directory, one
downloaded from a Hub), and a chat template with default arguments a request overrides."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.adapters import make_adapter
from tests.fakehub import FakeHub
from tests.support import Gateway, Process, start_runner

MODEL = "orchard-demo"
HUB_ADAPTER = "orchard-test/lora-b"
MAX_TOKENS = 12
Messages = list[ChatCompletionMessageParam]


class Reference:
    """In-process mlx-lm on the built-in model, with an adapter or a template: what the
    runner must reproduce exactly."""

    def __init__(self, model: Path, adapter: Path | None = None) -> None:
        from mlx_lm import load

        loaded: Any = load(str(model), adapter_path=None if adapter is None else str(adapter))
        self.model, self.tokenizer = loaded[0], loaded[1]

    def prompt(self, messages: Messages, **template: Any) -> list[int]:
        tokens: list[int] = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **template
        )
        return tokens

    def greedy(self, prompt: list[int]) -> str:
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_sampler

        pieces = stream_generate(
            self.model, self.tokenizer, prompt, max_tokens=MAX_TOKENS, sampler=make_sampler(0.0)
        )
        return "".join(piece.text for piece in pieces)


@pytest.fixture(scope="module")
def adapters(demo_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two adapters of the built-in model, by served id: lora-a in a directory, lora-b the
    Hub's (these are its files)."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        f"{MODEL}:lora-a": make_adapter(root / "lora-a", demo_model_path, seed=1),
        f"{MODEL}:lora-b": make_adapter(root / "hub" / "lora-b", demo_model_path, seed=2),
    }


@pytest.fixture(scope="module")
def adapter_gateway(
    adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    """A runner serving the built-in model without an adapter, with lora-a (a directory) and
    with lora-b (a Hub id, downloaded when first asked for)."""
    with FakeHub() as hub:
        hub.add(HUB_ADAPTER, adapters[f"{MODEL}:lora-b"])
        gateway = Gateway()
        runner = start_runner(
            gateway,
            *("--model", MODEL, "--adapter-path", f"{MODEL}="),
            *("--adapter-path", f"{MODEL}={adapters[f'{MODEL}:lora-a']}"),
            *("--adapter-path", f"{MODEL}={HUB_ADAPTER}"),
            env={"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path_factory.mktemp("hf"))},
        )
        try:
            gateway.wait_for_runners(1)
            yield gateway
        finally:
            stop(runner, gateway)


def stop(runner: Process, gateway: Gateway) -> None:
    printed = runner.stop()
    gateway.stop()
    assert runner.proc.returncode == 0, printed  # drained and ended cleanly


def client_of(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="unused", max_retries=0)


def test_models_lists_each_adapter_as_its_own_model(adapter_gateway: Gateway) -> None:
    with client_of(adapter_gateway) as client:
        ids = sorted(model.id for model in client.models.list())
    assert ids == [MODEL, f"{MODEL}:lora-a", f"{MODEL}:lora-b"]


def test_the_client_picks_an_adapter_by_name(
    adapter_gateway: Gateway, adapters: dict[str, Path], demo_model_path: Path
) -> None:
    messages: Messages = [{"role": "user", "content": "Tell me about pears."}]
    answers = {}
    with client_of(adapter_gateway) as client:
        for served in (MODEL, *adapters):
            reference = Reference(demo_model_path, adapters.get(served))
            prompt = reference.prompt(messages)
            done = client.chat.completions.create(
                model=served, messages=messages, max_tokens=MAX_TOKENS, temperature=0
            )
            assert done.model == served
            answers[served] = done.choices[0].message.content
            assert answers[served] == reference.greedy(prompt), served
            assert done.usage is not None
            assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (
                len(prompt),
                MAX_TOKENS,
            )
    assert len(set(answers.values())) == 3, answers  # each adapter answers otherwise


GREETING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ greeting | default('Hi') }}, {{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def template_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A runner whose chat template (a file) greets with its `--chat-template-args`."""
    template = tmp_path_factory.mktemp("template") / "greeting.jinja"
    template.write_text(GREETING_TEMPLATE)
    gateway = Gateway()
    runner = start_runner(
        gateway,
        *("--model", MODEL, "--chat-template", str(template)),
        *("--chat-template-args", json.dumps({"greeting": "Good day"})),
    )
    try:
        gateway.wait_for_runners(1)
        yield gateway
    finally:
        stop(runner, gateway)


@pytest.mark.parametrize(
    ("asked", "greeting"),
    [
        (None, "Good day"),
        ({"greeting": "A very warm good evening to you"}, "A very warm good evening to you"),
        ({"enable_thinking": False}, "Good day"),
    ],
)
def test_the_template_and_its_arguments_make_the_prompt(
    template_gateway: Gateway,
    demo_model_path: Path,
    asked: dict[str, Any] | None,
    greeting: str,
) -> None:
    reference = Reference(demo_model_path)
    messages: Messages = [{"role": "user", "content": "Name a fruit."}]
    prompt = reference.prompt(messages, chat_template=GREETING_TEMPLATE, greeting=greeting)
    assert reference.tokenizer.decode(prompt).startswith(f"<|im_start|>user\n{greeting}, Name")
    extra = {} if asked is None else {"chat_template_kwargs": asked}
    with client_of(template_gateway) as client:
        done = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
        )
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(prompt), MAX_TOKENS)
    assert done.choices[0].message.content == reference.greedy(prompt)
    assert len(prompt) != len(reference.prompt(messages))  # not the model's own template
