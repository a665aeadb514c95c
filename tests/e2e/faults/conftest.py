"""The fault modules' fixtures (their processes and clients: tests.e2e.faults.harness).

The tests that kill, freeze, drain, restart or reconfigure nothing of a gateway share one
for the package (`fleet`); a test's own runners on it are gone when the test ends. A test
that stops or restarts a gateway starts its own (`cluster`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from tests.e2e.faults.harness import Cluster, Fleet, Tasks
from tests.support import UNIT, Gateway


@pytest.fixture(scope="package")
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    try:
        yield f
    finally:
        f.close()


@pytest.fixture(autouse=True)
def _settled(fleet: Fleet) -> Iterator[None]:
    """Set up before, so torn down after, every other fixture of a test."""
    yield
    fleet.settle()


@pytest.fixture
def gateway(fleet: Fleet) -> Gateway:
    """The fleet's default gateway."""
    return fleet.gateway()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=30 * UNIT, limits=limits) as client:
        yield client


@pytest.fixture
async def tasks() -> AsyncIterator[Tasks]:
    t = Tasks()
    try:
        yield t
    finally:
        await t.close()
