"""Find the gateway on the LAN over mDNS / DNS-SD (python-zeroconf): `orchard runner` with no
URL, or with `--gateway NAME`.

The runner browses for `protocol.discovery.SERVICE_TYPE` a short window at a time and
resolves what answers into `Advertisement`s. One gateway (or the one named) → its URL;
several and none named → `AmbiguousGateway`, listing them; none yet → it says so once and
keeps looking. A runner that loses its gateway looks it up again before reconnecting (its
address may have changed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from zeroconf import IPVersion, ServiceStateChange
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from protocol.discovery import SERVICE_TYPE, Advertisement
from protocol.errors import AdvertisementError
from runner.errors import AmbiguousGateway

log = logging.getLogger("runner.discovery")

WINDOW_S = 1.0
"""How long one browse listens for answers before choosing."""
PATIENCE_S = 3.0
"""How long the runner looks before it says that nothing answered (it keeps looking)."""
RESOLVE_MS = 1500
"""How long resolving one found service may take."""


async def browse(window: float = WINDOW_S) -> list[Advertisement]:
    """The Orchard gateways that answer within `window` seconds."""
    zeroconf = AsyncZeroconf(ip_version=IPVersion.V4Only)
    names: set[str] = set()

    def on_change(
        zeroconf: Any, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        if state_change is not ServiceStateChange.Removed:
            names.add(name)
        else:
            names.discard(name)

    browser = AsyncServiceBrowser(zeroconf.zeroconf, SERVICE_TYPE, handlers=[on_change])
    try:
        await asyncio.sleep(window)
        found = []
        for name in sorted(names):
            info = AsyncServiceInfo(SERVICE_TYPE, name)
            if not await info.async_request(zeroconf.zeroconf, RESOLVE_MS):
                continue
            try:
                found.append(
                    Advertisement.parse(
                        info.port or 0, info.parsed_scoped_addresses(), info.properties
                    )
                )
            except AdvertisementError as exc:
                log.warning("ignoring %s: %s", name, exc)
        return found
    finally:
        await browser.async_cancel()
        await zeroconf.async_close()


def choose(found: Sequence[Advertisement], wanted: str | None) -> Advertisement | None:
    """The gateway to join among those `found`: the one named `wanted`, or the only one;
    None while there is none (keep looking). `AmbiguousGateway`, listing them, when several
    answer and none was named."""
    if wanted is not None:
        return next((ad for ad in found if ad.name == wanted), None)
    if len(found) <= 1:
        return found[0] if found else None
    listing = "\n".join(f"  {ad.describe()}" for ad in sorted(found, key=lambda a: a.name))
    raise AmbiguousGateway(
        f"{len(found)} gateways answer on this network:\n{listing}\n"
        "Choose one with --gateway NAME (or give its URL)."
    )


async def find_gateway(
    wanted: str | None, *, window: float = WINDOW_S, patience: float = PATIENCE_S
) -> Advertisement:
    """Browse until a gateway to join answers (see `choose`); says once when none has after
    `patience` seconds, and keeps looking."""
    started = time.monotonic()
    told = False
    what = f"a gateway named {wanted!r}" if wanted else "an Orchard gateway"
    while True:
        chosen = choose(await browse(window), wanted)
        if chosen is not None:
            log.info("found gateway %s", chosen.describe())
            return chosen
        if not told and time.monotonic() - started >= patience:
            told = True
            log.warning(
                "no answer from %s on this network (mDNS %s) yet; still looking. Start one "
                "with `orchard gateway --host 0.0.0.0`, or give its URL with --gateway.",
                what,
                SERVICE_TYPE,
            )
