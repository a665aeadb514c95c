"""What the gateway's test modules share, on each module's own `gateway` fixture: a plain
httpx client and a fake runner."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from tests.support import UNIT, FakeRunner, Gateway


@pytest.fixture
async def http(gateway: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client on the `gateway` fixture of the module that asks for it."""
    async with httpx.AsyncClient(base_url=gateway.base, timeout=10 * UNIT) as client:
        yield client


@pytest.fixture
async def runner(gateway: Gateway) -> AsyncIterator[FakeRunner]:
    """A fake runner connected to the module's `gateway` (tests.support.FakeRunner)."""
    fake = await FakeRunner.connect(gateway)
    yield fake
    await fake.close()
