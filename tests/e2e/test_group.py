"""A runner group end to end: `orchard runner --local-group 2` (two processes on MLX's CPU
backend, ring over loopback) serving the built-in model split in two pipeline stages, behind
a real gateway, asked with the real openai SDK.

Greedy output must equal the single-process engine's token for token (the same tokens, by
their logprobs entries, and the same text), with exact usage, alone and batched; cancel and
disconnect stop generation and leave the group in lock step;
killing one member mid-stream ends its requests with `runner_lost`, removes the group
within the liveness timeout and leaves no member process behind, while a single runner
beside it keeps serving.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import httpx
import openai
import orjson
import psutil
import pytest
from websockets.asyncio.client import connect

from protocol.frames import Generate, Message, SamplingParams
from runner.demo_model import DEMO_PIPELINE_MODEL_ID
from runner.engine.base import Output
from runner.engine.batched import batched_engine
from tests.runner.collect import Collector
from tests.support import (
    UNIT,
    Gateway,
    Process,
    page_problems,
    secs,
    start_runner,
    wait_until,
)

if TYPE_CHECKING:
    from playwright.sync_api import Browser

MODEL = DEMO_PIPELINE_MODEL_ID
PROMPTS = ["Tell me about pears.", "Hello", "Why do orchards need bees?", "Say something."]
TOKENS = 24
LIVENESS = 3.0
"""The runners' --liveness-timeout (their default) in the time unit, which is also the group's
timeout: its members' watchdogs, and how long its supervisor waits for them after a failure."""
RUNNER_LIVENESS = ("--liveness-timeout", secs(LIVENESS))

pytestmark = pytest.mark.timeout(int(180 * UNIT))


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    gw = Gateway("--liveness-timeout", secs(2.5))  # its default, in the time unit
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def group(gateway: Gateway) -> Iterator[Process]:
    proc = start_runner(
        gateway,
        *("--model", MODEL, "--local-group", "2", "--max-concurrent", "4", *RUNNER_LIVENESS),
        name="grp",
    )
    try:
        wait_until(lambda: _listed(gateway, "grp", proc), 90, "the group to register")
        yield proc
    finally:
        proc.stop()


def _listed(gateway: Gateway, name: str, proc: Process) -> bool:
    if not proc.alive():
        raise AssertionError(f"the group exited:\n{proc.stop()}")
    return any(r["name"] == name for r in gateway.runners())


@pytest.fixture(scope="module")
def expected() -> dict[str, tuple[list[str], str]]:
    """Each prompt's greedy tokens and text from the single-process batched engine."""
    collector = Collector()
    engine = batched_engine(MODEL, max_concurrent=4)
    engine.start(collector)
    try:
        answers = {}
        for i, prompt in enumerate(PROMPTS):
            # One at a time: a lone request's logits do not depend on what runs beside it.
            engine.submit(_generate(f"r{i}", prompt))
            outputs = [e for e in collector.wait(f"r{i}") if isinstance(e, Output)]
            tokens = [lp.token for o in outputs for lp in o.logprobs]
            answers[prompt] = (tokens, "".join(o.text for o in outputs))
            assert outputs[-1].usage.completion_tokens == TOKENS
        return answers
    finally:
        engine.close()


def _generate(request_id: str, prompt: str) -> Generate:
    return Generate(
        request_id,
        MODEL,
        (Message("user", prompt),),
        max_tokens=TOKENS,
        sampling=SamplingParams(temperature=0.0),
        logprobs=True,
    )


@pytest.fixture
async def client(gateway: Gateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{gateway.base}/v1", api_key="unused") as c:
        yield c


def _runner(gateway: Gateway, name: str) -> dict[str, Any] | None:
    return next((r for r in gateway.runners() if r["name"] == name), None)


async def _end_of(stream: Any) -> str:
    """How a stream ended: its error, or its finish reason."""
    finish = None
    try:
        async for chunk in stream:
            finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
    except openai.APIError as exc:
        return f"error: {exc.body or exc}"
    return f"finished: {finish}"


def _members(proc: Process) -> dict[int, psutil.Process]:
    """The group's member processes by rank (the supervisor's children)."""
    members = {}
    for child in psutil.Process(proc.proc.pid).children():
        members[int(child.environ()["MLX_RANK"])] = child
    return members


def test_group_registers_as_one_runner_listing_its_members(
    gateway: Gateway, group: Process
) -> None:
    info = _runner(gateway, "grp")
    assert info is not None
    assert [m["id"] for m in info["models"]] == [MODEL]
    assert info["models"][0]["engine"].endswith("pipeline split over 2 ranks")
    assert info["max_concurrent"] == 4
    assert len(info["members"]) == 2
    assert info["members"][0] == info["hardware"]
    assert sorted(_members(group)) == [0, 1]


async def test_greedy_output_equals_the_single_process_engine(
    gateway: Gateway,
    group: Process,
    client: openai.AsyncOpenAI,
    expected: dict[str, tuple[list[str], str]],
) -> None:
    before = _runner(gateway, "grp")
    assert before is not None

    async def ask(prompt: str) -> Any:
        return await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=TOKENS,
            temperature=0,
            logprobs=True,
        )

    for prompt in PROMPTS:
        answer = await ask(prompt)
        tokens, text = expected[prompt]
        choice = answer.choices[0]
        assert [t.token for t in choice.logprobs.content] == tokens, prompt
        assert choice.message.content == text, prompt
        assert choice.finish_reason == "length"
        assert answer.usage.completion_tokens == TOKENS

    # All at once: the group decodes them as one batch, every rank the same batch (the
    # demo model's logits are peaked, so a batch row's rounding does not change its tokens).
    batched = await asyncio.gather(*(ask(p) for p in PROMPTS))
    for prompt, answer in zip(PROMPTS, batched, strict=True):
        assert [t.token for t in answer.choices[0].logprobs.content] == expected[prompt][0]
        assert answer.usage.completion_tokens == TOKENS
    info = _runner(gateway, "grp")
    assert info is not None
    assert info["requests_served"] - before["requests_served"] == 2 * len(PROMPTS)


async def test_usage_is_exact_streamed(
    group: Process, client: openai.AsyncOpenAI, expected: dict[str, tuple[list[str], str]]
) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for chunk in stream:
        text += "".join(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    assert text == expected[PROMPTS[0]][1]
    assert usage is not None
    # The same request again hits the prefix cache: its prompt less the last token is cached.
    assert usage.completion_tokens == TOKENS
    single = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=1
    )
    assert single.usage is not None
    assert usage.prompt_tokens == single.usage.prompt_tokens > 0
    # The prefix cache of every rank: the prompt was seen before, all but its last token
    # comes from the cache (as on one process; the last one is fed to get the first logits).
    assert single.usage.prompt_tokens_details is not None
    assert single.usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


async def test_disconnect_and_cancel_stop_generation_and_keep_lock_step(
    gateway: Gateway,
    group: Process,
    client: openai.AsyncOpenAI,
    expected: dict[str, tuple[list[str], str]],
) -> None:
    before = _runner(gateway, "grp")
    assert before is not None
    # An SSE client that goes away after a few chunks.
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Go on and on."}],
        max_tokens=1500,
        temperature=0,
        stream=True,
    )
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 4:
            break
    await stream.close()
    # A browser-socket client that cancels.
    async with connect(f"ws://127.0.0.1:{gateway.port}/v1/ws") as ws:
        create = {
            "type": "chat.completions.create",
            "request_id": "long",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": "More."}],
                     "max_tokens": 1500},
        }  # fmt: skip
        await ws.send(orjson.dumps(create), text=True)
        msg: dict[str, Any] = {"type": ""}
        while msg["type"] != "chunk":
            msg = orjson.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT))
        await ws.send(orjson.dumps({"type": "cancel", "request_id": "long"}), text=True)
        while msg["type"] == "chunk":
            msg = orjson.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT))
        assert msg["type"] == "done", msg
        assert msg["finish_reason"] == "cancelled"
        assert 0 < msg["usage"]["completion_tokens"] < 1500

    def stopped() -> bool:
        info = _runner(gateway, "grp")
        return info is not None and info["active"] == 0

    wait_until(stopped, 3, "the group to stop both requests")
    after = _runner(gateway, "grp")
    assert after is not None
    # Far fewer than the 3000 tokens asked for: generation stopped, it did not run on.
    assert after["tokens_generated"] - before["tokens_generated"] < 600
    # Still in lock step: the next answer is the single-process engine's.
    answer = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPTS[1]}],
        max_tokens=TOKENS,
        temperature=0,
    )
    assert answer.choices[0].message.content == expected[PROMPTS[1]][1]


def test_console_shows_the_group_and_its_members(
    gateway: Gateway, group: Process, browser: Browser
) -> None:
    context = browser.new_context()
    try:
        page = context.new_page()
        problems = page_problems(page)
        page.goto(f"{gateway.base}/")
        cell = page.locator('tr[data-runner-name="grp"] td[data-col="hardware"]')
        cell.wait_for(timeout=15_000 * UNIT)
        assert cell.inner_text().endswith(" · group of 2")
        title = cell.get_attribute("title") or ""
        assert [line.split(":")[0] for line in title.splitlines()] == ["rank 0", "rank 1"]
    finally:
        context.close()
    assert not problems, problems


async def test_member_killed_mid_stream_ends_the_group_and_its_requests(
    gateway: Gateway, group: Process, client: openai.AsyncOpenAI
) -> None:
    solo = start_runner(
        gateway, "--model", MODEL, "--max-concurrent", "1", *RUNNER_LIVENESS, name="solo"
    )
    try:
        wait_until(lambda: _listed(gateway, "solo", solo), 60, "the single runner")
        members = _members(group)
        # The group has the most free slots: both streams go to it.
        streams = [
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Story {i}"}],
                max_tokens=1800,
                temperature=0,
                stream=True,
            )
            for i in range(2)
        ]
        firsts = [await anext(aiter(s)) for s in streams]
        assert all(f.choices for f in firsts)
        info = _runner(gateway, "grp")
        assert info is not None
        assert info["active"] == 2, [
            (r["name"], r["active"], r["requests_served"]) for r in gateway.runners()
        ]

        members[1].kill()
        killed_at = time.monotonic()
        # Sent while the group dies: it most likely goes to the group (the most free slots)
        # and has not started when the group is lost, so it must fail over to the single
        # runner; either way it completes.
        late = asyncio.create_task(
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Late."}], max_tokens=5
            )
        )
        ends = [await _end_of(stream) for stream in streams]
        assert all("runner_lost" in end for end in ends), (ends, group.stop())
        assert time.monotonic() - killed_at < LIVENESS * UNIT
        wait_until(
            lambda: _runner(gateway, "grp") is None,
            max(LIVENESS - (time.monotonic() - killed_at) / UNIT, 0.05),
            "the group to leave the pool within the liveness timeout",
        )
        # The surviving member said why it left: at once, told by the group's supervisor or
        # failing its step (whichever came first), not found out by its watchdog a liveness
        # timeout later. Nothing of the group is left running.
        group.proc.wait(10 * UNIT)
        printed = group.stop()
        at_once = ("the group's supervisor saw another member fail", "a step failed: ")
        assert any(f"leaving the runner group: rank 0: {why}" in printed for why in at_once), (
            printed
        )
        assert group.proc.returncode == 1
        assert not any(
            m.is_running() and m.status() != psutil.STATUS_ZOMBIE for m in members.values()
        )

        late_answer = await asyncio.wait_for(late, 10 * UNIT)
        assert late_answer.usage is not None
        assert late_answer.usage.completion_tokens == 5
        # The single runner beside it serves on.
        answer = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Still there?"}], max_tokens=5
        )
        assert answer.usage is not None
        assert answer.usage.completion_tokens == 5
        async with httpx.AsyncClient() as http:
            runners = (await http.get(f"{gateway.base}/v1/runners")).json()["data"]
        assert [r["name"] for r in runners] == ["solo"]
    finally:
        solo.stop()
