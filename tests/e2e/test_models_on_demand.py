"""A runner serving several models, loaded on demand within --max-memory: real mlx-lm models,
a real gateway, the openai SDK as the client, and a model downloaded from a (fake, local) Hugging
Face Hub with the real huggingface_hub client, its progress visible in /v1/runners."""

from __future__ import annotations

import contextlib
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
from playwright.sync_api import expect

from runner.demo_model import DEMO_MODEL_ID, resolve_model
from tests.fakehub import FakeHub
from tests.support import (
    UNIT,
    Gateway,
    Process,
    page_problems,
    start_runner,
    wait_until,
    weights_bytes,
)

if TYPE_CHECKING:
    from playwright.sync_api import Browser

MS = 1000 * UNIT
"""Playwright counts in milliseconds."""

HUB_MODEL = "orchard-test/demo-hub"
MISSING = "orchard-test/no-such-model"
BUDGET = "4MB"
"""Two of the demo model's copies (1.8 MB of weights each) fit, three do not."""


@pytest.fixture(scope="module")
def pool(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Gateway, Process, FakeHub, str]]:
    demo = Path(resolve_model(DEMO_MODEL_ID))
    copy = tmp_path_factory.mktemp("models") / "demo-copy"
    shutil.copytree(demo, copy)
    with FakeHub() as hub:
        hub.add(HUB_MODEL, demo)
        gateway = Gateway()
        runner = start_runner(
            gateway,
            "--model",
            DEMO_MODEL_ID,
            "--model",
            str(copy),
            "--model",
            HUB_MODEL,
            "--model",
            MISSING,
            "--max-memory",
            BUDGET,
            "--log-level",
            "info",
            env=hub_env(hub, tmp_path_factory),
        )
        try:
            gateway.wait_for_runners(1)
            yield gateway, runner, hub, str(copy)
        finally:
            runner.stop()
            gateway.stop()


def hub_env(hub: FakeHub, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A runner's environment: the fake hub for the Hub, a Hub cache of its own."""
    return {
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp_path_factory.mktemp("hf-home")),
        "HF_HUB_DISABLE_XET": "1",
    }


def model_states(gateway: Gateway) -> dict[str, str]:
    data = httpx.get(f"{gateway.base}/v1/models", timeout=5 * UNIT).json()["data"]
    return {entry["id"]: entry["state"] for entry in data}


def runner_models(gateway: Gateway) -> dict[str, dict[str, Any]]:
    (runner,) = gateway.runners()
    return {m["id"]: m for m in runner["models"]}


def ask(client: openai.OpenAI, model: str) -> tuple[str, Any]:
    completion = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name a fruit."}],
        max_tokens=8,
        temperature=0,
    )
    return completion.choices[0].message.content or "", completion.usage


def test_models_load_on_demand_within_the_budget(
    pool: tuple[Gateway, Process, FakeHub, str], browser: Browser
) -> None:
    gateway, _runner, hub, copy = pool
    client = openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="none", max_retries=0)
    assert model_states(gateway) == {
        DEMO_MODEL_ID: "loaded",
        copy: "loadable",
        HUB_MODEL: "loadable",
        MISSING: "loadable",
    }
    (info,) = gateway.runners()
    assert info["memory_budget_bytes"] == 4_000_000
    demo_size = runner_models(gateway)[DEMO_MODEL_ID]["size_bytes"]
    assert (
        runner_models(gateway)[copy]["size_bytes"]
        == (Path(copy) / "model.safetensors").stat().st_size
    )
    assert runner_models(gateway)[HUB_MODEL]["size_bytes"] is None  # not downloaded yet

    # A Hub model: downloaded (its progress in /v1/runners and the console; the hub holds
    # the weights back halfway until released), loaded, then it answers exactly as the demo
    # model it is a copy of.
    # The client reports progress once per MiB read: stall past the first one.
    weights = (Path(copy) / "model.safetensors").stat().st_size
    hub.stall_after = 3 * weights // 4
    answers: list[tuple[str, Any]] = []
    asking = threading.Thread(target=lambda: answers.append(ask(client, HUB_MODEL)))
    asking.start()
    seen: list[dict[str, Any]] = []

    def stalled() -> bool:
        model = runner_models(gateway)[HUB_MODEL]
        if model["download"] is not None:
            seen.append(model)
        return model["download"] is not None and model["download"]["done_bytes"] >= 2**20

    wait_until(stalled, 60, "the hub model's download to reach the stall")
    watch_the_console(gateway, hub, copy, browser)
    asking.join(30 * UNIT)
    assert all(m["state"] == "loading" for m in seen)
    done = [m["download"]["done_bytes"] for m in seen]
    assert done == sorted(done)
    assert seen[-1]["download"]["total_bytes"] > weights
    assert hub.body_requests()  # it really came from the hub
    (hub_answer,) = answers
    assert ask(client, DEMO_MODEL_ID) == hub_answer
    assert model_states(gateway)[HUB_MODEL] == "loaded"

    # A third model does not fit: the least recently used (the hub model: the demo model
    # answered after it) is unloaded to make room.
    text, usage = ask(client, copy)
    assert (text, usage) == hub_answer
    assert model_states(gateway) == {
        DEMO_MODEL_ID: "loaded",
        copy: "loaded",
        HUB_MODEL: "loadable",
        MISSING: "loadable",
    }
    (info,) = gateway.runners()
    loaded = {m["id"]: m["size_bytes"] for m in info["models"] if m["state"] == "loaded"}
    assert loaded == {DEMO_MODEL_ID: demo_size, copy: weights_bytes(Path(copy))}
    assert demo_size == weights_bytes(Path(resolve_model(DEMO_MODEL_ID)))
    assert sum(loaded.values()) <= 4_000_000
    # Ollama's /api/ps lists what is loaded now, /api/tags everything served.
    ps = httpx.get(f"{gateway.base}/api/ps", timeout=5 * UNIT).json()
    assert sorted(m["name"] for m in ps["models"]) == sorted([DEMO_MODEL_ID, copy])
    tags = httpx.get(f"{gateway.base}/api/tags", timeout=5 * UNIT).json()
    assert len(tags["models"]) == 4


def watch_the_console(gateway: Gateway, hub: FakeHub, copy: str, browser: Browser) -> None:
    """The console shows the download's progress, then the model loaded once the hub lets
    the rest of it go."""
    with contextlib.closing(browser.new_context()) as context:
        page = context.new_page()
        problems = page_problems(page)
        page.goto(f"{gateway.base}/")
        chip = page.locator(f'#runners [data-model="{HUB_MODEL}"]')
        expect(chip).to_have_attribute("data-state", "loading", timeout=15 * MS)
        expect(chip).to_have_text(re.compile(rf"^{re.escape(HUB_MODEL)} · \d+ %$"))
        expect(page.locator(f'#runners [data-model="{copy}"]')).to_have_attribute(
            "data-state", "loadable"
        )
        hub.release()
        expect(chip).to_have_attribute("data-state", "loaded", timeout=30 * MS)
        expect(chip).to_have_text(HUB_MODEL)
        assert not problems, problems


def test_a_model_that_cannot_be_downloaded_is_a_clear_error(
    pool: tuple[Gateway, Process, FakeHub, str],
) -> None:
    gateway, runner, _hub, _copy = pool
    client = openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.InternalServerError) as raised:
        ask(client, MISSING)
    error = raised.value
    assert error.status_code == 503
    body = error.body
    assert isinstance(body, dict)
    assert body["code"] == "model_load_failed"
    assert body["type"] == "server_error"
    assert body["message"].startswith(f"Could not load {MISSING}: ")
    assert f"{MISSING} was not found on " in body["message"]
    missing = runner_models(gateway)[MISSING]
    assert missing["state"] == "loadable"
    assert missing["error"] == body["message"].removeprefix("Could not load ").removesuffix(".")
    # The runner and its other models are unharmed.
    assert ask(client, DEMO_MODEL_ID)[0]
    assert runner.alive()


def test_the_runner_logs_the_download(pool: tuple[Gateway, Process, FakeHub, str]) -> None:
    gateway, runner, _hub, _copy = pool
    if model_states(gateway)[HUB_MODEL] != "loaded":
        client = openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="none", max_retries=0)
        ask(client, HUB_MODEL)
    runner.log.seek(0)
    log = runner.log.read().decode(errors="replace")
    assert f"downloading {HUB_MODEL}" in log, log
    assert f"unloading {HUB_MODEL} to make room for" in log, log


def test_a_runner_of_one_hub_model_downloads_it_then_joins(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    with FakeHub() as hub:
        hub.add(HUB_MODEL, Path(resolve_model(DEMO_MODEL_ID)))
        gateway = Gateway()
        runner = start_runner(
            gateway,
            *("--model", HUB_MODEL, "--log-level", "info"),
            env=hub_env(hub, tmp_path_factory),
        )
        try:
            gateway.wait_for_runners(1)
            assert model_states(gateway) == {HUB_MODEL: "loaded"}
            client = openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="none", max_retries=0)
            assert ask(client, HUB_MODEL)[0]
            assert len(hub.body_requests()) >= 2  # weights, config, tokenizer: from the hub
        finally:
            log = runner.stop()
            gateway.stop()
    assert f"downloaded {HUB_MODEL}: " in log, log
