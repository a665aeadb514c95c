"""Returning freed memory to the OS once a load of streams is over. The trimmer's timer runs
on a virtual clock (tests.gateway.virtual_time): each check is at an exact time from `idle()`,
however busy the machine."""

from __future__ import annotations

import asyncio
import gc
import sys
import warnings

import pytest

from gateway.pool.memory import IdleTrimmer, release_free_memory
from tests.gateway.virtual_time import virtual_time

DELAY = 0.05


@pytest.fixture(autouse=True)
def _earlier_garbage_collected() -> None:
    """A trim runs the cyclic garbage collector, which finalises whatever earlier tests in this
    process left in reference cycles: an unclosed socket among it would fail this test, not the
    one that left it (it did, twice in ten runs of the suite). Collect it before, unreported
    here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_works_here() -> None:
    assert release_free_memory()


@virtual_time
async def test_a_big_load_is_trimmed_after_the_idle_delay() -> None:
    trimmer = IdleTrimmer(delay=DELAY, min_streams=4)
    for n in range(1, 6):
        trimmer.busy(n)
    trimmer.idle()
    await asyncio.sleep(DELAY * 0.9)
    assert trimmer.trims == 0  # not before the delay
    await asyncio.sleep(DELAY * 0.2)
    assert trimmer.trims == 1
    trimmer.idle()  # nothing new ran: no second trim
    await asyncio.sleep(DELAY * 2)
    assert trimmer.trims == 1


@virtual_time
async def test_a_small_load_is_not_trimmed() -> None:
    trimmer = IdleTrimmer(delay=DELAY, min_streams=4)
    trimmer.busy(3)
    trimmer.idle()
    await asyncio.sleep(DELAY * 2)
    assert trimmer.trims == 0


@virtual_time
async def test_a_new_stream_puts_the_trim_off() -> None:
    trimmer = IdleTrimmer(delay=DELAY, min_streams=2)
    trimmer.busy(2)
    trimmer.idle()
    await asyncio.sleep(DELAY * 0.6)
    trimmer.busy(1)  # a closed loop of requests never pays for a trim
    await asyncio.sleep(DELAY * 2)
    assert trimmer.trims == 0
    trimmer.idle()
    await asyncio.sleep(DELAY * 0.9)
    assert trimmer.trims == 0  # the delay counts from this idle, not the first
    await asyncio.sleep(DELAY * 0.2)
    assert trimmer.trims == 1
