"""What the end-to-end modules share for the whole run: a gateway with a real mlx runner per
engine configuration, and one headless Chromium.

A stack is started the first time a module asks for it and stopped when the run ends, so the
dozen modules that talk to "a gateway with a real runner on the built-in model" start two
stacks between them instead of one each. Tests on a shared stack must not depend on what
other modules did before them: each uses prompts of its own (a cached-token count is then
exact), reads counters as differences, and leaves no request running. A test that kills,
restarts or reconfigures a process starts its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import openai
import pytest

from tests.support import Gateway, Process, Stacks, chromium

if TYPE_CHECKING:
    from playwright.sync_api import Browser


@pytest.fixture(scope="session", autouse=True)
def _built_model(demo_model_path: Path) -> Path:
    """Every runner these modules start finds the built-in model already built."""
    return demo_model_path


@pytest.fixture(scope="session")
def stacks() -> Iterator[Stacks]:
    shared = Stacks()
    try:
        yield shared
    finally:
        shared.close()


@pytest.fixture(scope="module")
def stack(stacks: Stacks) -> tuple[Gateway, Process]:
    """The shared stack on the default engine (a module that needs another defines its own)."""
    return stacks.get()


@pytest.fixture(scope="module")
def client(stack: tuple[Gateway, Process]) -> Iterator[openai.OpenAI]:
    """The openai SDK on the module's `stack` (a module of another dialect defines its own
    `client`)."""
    with openai.OpenAI(base_url=f"{stack[0].base}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="session")
def _chromium() -> Iterator[tuple[Browser, asyncio.AbstractEventLoop]]:
    """One headless Chromium for the whole run, and the event loop of Playwright's sync API.

    That API keeps its loop marked as this thread's running loop for as long as it lives
    (playwright/_impl/_greenlets.py), and asyncio refuses to start another loop while one is
    marked: the async tests after the first browser test would all fail. So the mark is
    taken off here and put back only while a test uses the browser (`browser`).
    """
    with chromium() as launched:
        loop = asyncio.get_running_loop()
        asyncio.events._set_running_loop(None)
        try:
            yield launched, loop
        finally:
            asyncio.events._set_running_loop(loop)  # closing talks to the driver


@pytest.fixture
def browser(_chromium: tuple[Browser, asyncio.AbstractEventLoop]) -> Iterator[Browser]:
    """The run's Chromium, for one test; it opens a context of its own."""
    launched, loop = _chromium
    asyncio.events._set_running_loop(loop)
    try:
        yield launched
    finally:
        asyncio.events._set_running_loop(None)
