"""Prompt reuse across a pool, end to end: a gateway and three real mlx runners on the
built-in model (each with its own disk cache), spoken to with each dialect's official client.
A conversation goes back to the runner that holds it and reuses all of its previous turn,
in every dialect's own cached-token field; conversations that share nothing spread; a
restarted runner brings its conversations back from disk."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

from runner.demo_model import DEMO_MODEL_ID
from tests.support import UNIT, Gateway, Process, start_runner, wait_until

MODEL = DEMO_MODEL_ID
RUNNERS = 3

pytestmark = pytest.mark.timeout(int(300 * UNIT))


class Trio:
    """The gateway and its three runners, each runner with a cache directory of its own."""

    def __init__(self, demo_model_path: Path, root: Path) -> None:
        self.gateway = Gateway()
        self.caches: dict[str, Path] = {}
        self.runners: dict[str, Process] = {}
        try:
            for i in range(RUNNERS):
                name = f"reuse-{i}"
                cache = root / name
                shutil.copytree(demo_model_path, cache / "models" / demo_model_path.name)
                self.caches[name] = cache
                self.runners[name] = self.start(name)
            self.gateway.wait_for_runners(RUNNERS)
        except BaseException:
            self.stop()
            raise

    def start(self, name: str) -> Process:
        env = {"ORCHARD_CACHE_DIR": str(self.caches[name])}
        return start_runner(
            self.gateway, "--model", MODEL, "--max-concurrent", "4", name=name, env=env
        )

    def served(self) -> dict[str, int]:
        return {r["name"]: r["requests_served"] for r in self.gateway.runners()}

    def stop(self) -> None:
        for runner in self.runners.values():
            runner.stop()
        self.gateway.stop()


@pytest.fixture(scope="module")
def trio(demo_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    made = Trio(demo_model_path, tmp_path_factory.mktemp("reuse"))
    yield made
    made.stop()


@pytest.fixture(scope="module")
def client(trio: Trio) -> Iterator[openai.OpenAI]:
    base = f"{trio.gateway.base}/v1"
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0) as made:
        yield made


def system_prompt(tag: str) -> str:
    return " ".join(f"{tag}: rule {i}, answer about orchards." for i in range(40))


def moved(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """The runners that served requests between two readings."""
    return sorted(name for name in after if after[name] != before.get(name, 0))


def test_a_conversation_returns_to_its_runner_and_reuses_its_previous_turn(
    trio: Trio, client: openai.OpenAI
) -> None:
    messages: list[Any] = [
        {"role": "system", "content": system_prompt("chat")},
        {"role": "user", "content": "Tell me about pears."},
    ]
    where: list[list[str]] = []
    previous = 0
    for turn in range(5):
        before = trio.served()
        answer = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0
        )
        where.append(moved(before, trio.served()))
        usage = answer.usage
        assert usage is not None
        assert usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        if turn:
            # All of the previous turn's prompt at least (its answer's tokens too, unless
            # the template renders them otherwise).
            assert previous <= cached < usage.prompt_tokens, (turn, cached, previous)
        previous = usage.prompt_tokens
        messages += [
            {"role": "assistant", "content": answer.choices[0].message.content or ""},
            {"role": "user", "content": f"And then, {turn}?"},
        ]
    assert all(len(w) == 1 for w in where), where
    assert len({w[0] for w in where}) == 1, where  # every turn on the same runner


def test_conversations_that_share_nothing_spread_over_the_pool(
    trio: Trio, client: openai.OpenAI
) -> None:
    async def converse(tag: str) -> str:
        async with openai.AsyncOpenAI(
            base_url=f"{trio.gateway.base}/v1", api_key="unused", max_retries=0
        ) as aclient:
            await aclient.chat.completions.create(
                model=MODEL,
                messages=[
                    {"role": "system", "content": system_prompt(tag)},
                    {"role": "user", "content": "Hello"},
                ],
                max_tokens=40,
                temperature=0,
            )
        return tag

    before = trio.served()

    async def all_six() -> None:
        await asyncio.gather(*(converse(f"spread{i}") for i in range(6)))

    asyncio.run(all_six())
    after = trio.served()
    counts = [after[name] - before[name] for name in trio.runners]
    assert sum(counts) == 6
    assert min(counts) > 0, counts  # every runner works
    assert max(counts) <= 3 * min(counts), counts


def test_every_dialect_reports_the_reuse_in_its_own_field(
    trio: Trio, client: openai.OpenAI
) -> None:
    base = trio.gateway.base
    system = system_prompt("dialects")

    # Responses, the second turn by previous_response_id (instructions are not carried
    # over from it, as at OpenAI: given again, the prompt starts as the first one did).
    first = client.responses.create(
        model=MODEL, instructions=system, input="Hi", max_output_tokens=16
    )
    second = client.responses.create(
        model=MODEL,
        instructions=system,
        previous_response_id=first.id,
        input="More?",
        max_output_tokens=16,
    )
    assert first.usage is not None
    assert second.usage is not None
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens

    # Anthropic Messages: cached tokens are cache_read_input_tokens, outside input_tokens.
    with anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0) as claude:
        turn: list[Any] = [{"role": "user", "content": "Hello there"}]
        one = claude.messages.create(model=MODEL, system=system, messages=turn, max_tokens=6)
        two = claude.messages.create(
            model=MODEL,
            system=system,
            messages=[
                *turn,
                {
                    "role": "assistant",
                    "content": "".join(b.text for b in one.content if b.type == "text") or "ok",
                },
                {"role": "user", "content": "Go on."},
            ],
            max_tokens=6,
        )
    prompt_one = one.usage.input_tokens + (one.usage.cache_read_input_tokens or 0)
    assert (two.usage.cache_read_input_tokens or 0) >= prompt_one

    # Legacy completions: a prompt that goes on from the last.
    text = system + " Once upon a time"
    c1 = client.completions.create(model=MODEL, prompt=text, max_tokens=4, temperature=0)
    c2 = client.completions.create(
        model=MODEL, prompt=text + c1.choices[0].text + " and then", max_tokens=4, temperature=0
    )
    assert c1.usage is not None
    assert c2.usage is not None
    details = c2.usage.prompt_tokens_details
    assert details is not None
    assert (details.cached_tokens or 0) >= c1.usage.prompt_tokens - 1

    # The browser socket: its usage is chat's.
    async def over_the_socket() -> dict[str, Any]:
        async with connect(f"ws://127.0.0.1:{trio.gateway.port}/v1/ws") as ws:
            usage: dict[str, Any] = {}
            for i in range(2):
                request = {
                    "type": "chat.completions.create",
                    "request_id": f"sock{i}",
                    "body": {
                        "model": MODEL,
                        "messages": [
                            {"role": "system", "content": system},
                            {"role": "user", "content": "Same question"},
                        ],
                        "max_tokens": 4,
                        "temperature": 0,
                    },
                }
                await ws.send(orjson.dumps(request).decode())
                while True:
                    message = orjson.loads(await asyncio.wait_for(ws.recv(), 60 * UNIT))
                    if message.get("type") == "done" and message.get("request_id") == f"sock{i}":
                        usage = message["usage"]
                        break
            return usage

    usage = asyncio.run(over_the_socket())
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1

    # Ollama: prompt_eval_count is the whole prompt, as Ollama documents it (no cached
    # count in its shape); the reuse shows in the gateway's prompt tokens by source.
    with ollama.Client(host=base) as llama:
        options = {"num_predict": 4, "temperature": 0}
        turn = [{"role": "system", "content": system}, {"role": "user", "content": "Ollama here"}]
        first_chat = llama.chat(model=MODEL, messages=turn, options=options)
        before = reused_tokens(base)
        answer = {"role": "assistant", "content": first_chat.message.content or "ok"}
        llama.chat(
            model=MODEL,
            messages=[*turn, answer, {"role": "user", "content": "And?"}],
            options=options,
        )
    assert first_chat.prompt_eval_count is not None
    assert reused_tokens(base) - before >= first_chat.prompt_eval_count


def reused_tokens(base: str) -> float:
    """Prompt tokens the pool's runners took from a cache (memory or disk), so far."""
    text = httpx.get(f"{base}/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "orchard_prompt_tokens_by_source"
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels["source"] in ("memory", "disk")
    )


def test_a_restarted_runner_brings_its_conversation_back_from_disk(
    trio: Trio, client: openai.OpenAI
) -> None:
    messages: list[Any] = [
        {"role": "system", "content": system_prompt("restart")},
        {"role": "user", "content": "Before the restart."},
    ]
    before = trio.served()
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0
    )
    (holder,) = moved(before, trio.served())
    assert answer.usage is not None
    previous = answer.usage.prompt_tokens
    cache = trio.caches[holder] / "kv"
    wait_until(lambda: any(cache.rglob("*.sha256")), 30, "its cache on disk")

    trio.runners[holder].stop()
    wait_until(lambda: holder not in trio.served(), 30, f"{holder} to leave")
    trio.runners[holder] = trio.start(holder)
    trio.gateway.wait_for_runners(RUNNERS)

    def disk_tokens() -> float:
        text = httpx.get(f"{trio.gateway.base}/metrics", timeout=5).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("orchard_prompt_tokens_by_source_total{")
            and 'source="disk"' in line
            and f'runner="{holder}"' in line
        )

    read_before = disk_tokens()
    messages += [
        {"role": "assistant", "content": answer.choices[0].message.content or ""},
        {"role": "user", "content": "After the restart."},
    ]
    before = trio.served()
    after = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0
    )
    assert moved(before, trio.served()) == [holder]  # it said what it holds when it came back
    assert after.usage is not None
    details = after.usage.prompt_tokens_details
    assert details is not None
    cached = details.cached_tokens or 0
    assert cached >= 0.9 * previous
    assert disk_tokens() - read_before == cached  # read back from disk, not prefilled
