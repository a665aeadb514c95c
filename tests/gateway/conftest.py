"""What the gateway's test modules share: gateways by their options (`gateways`, and the two
that several modules use), and on each module's own `gateway` fixture a plain httpx client
and a fake runner."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from tests.gateway.gateways import FAKE_RUNNERS, SHORT_STREAM_TIMEOUT, Gateways
from tests.support import UNIT, FakeRunner, Gateway, secs


@pytest.fixture(scope="session")
def gateways() -> Iterator[Gateways]:
    shared = Gateways()
    yield shared
    shared.close()


@pytest.fixture(scope="module")
def patient_gateway(gateways: Gateways) -> Gateway:
    """Waits long for a first token (5 s): a runner's error before it is always an HTTP
    error."""
    return gateways.get("--first-token-wait", secs(5), *FAKE_RUNNERS)


@pytest.fixture(scope="module")
def short_timeout_gateway(gateways: Gateways) -> Gateway:
    """Ends a request after SHORT_STREAM_TIMEOUT without a frame from its runner, well before
    its first-token wait: silence before the first token is a 504, not a committed stream."""
    return gateways.get(
        "--stream-timeout", secs(SHORT_STREAM_TIMEOUT), "--first-token-wait", secs(5), *FAKE_RUNNERS
    )


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
