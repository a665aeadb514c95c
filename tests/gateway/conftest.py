"""What the gateway's test modules share: an HTTP client on the module's `gateway`."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from tests.support import UNIT, Gateway


@pytest.fixture
async def http(gateway: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client on the `gateway` fixture of the module that asks for it."""
    async with httpx.AsyncClient(base_url=gateway.base, timeout=10 * UNIT) as client:
        yield client
