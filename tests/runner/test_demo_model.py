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
    build_demo_model,
    resolve_model,
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
    for marker in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"):
        assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1
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
