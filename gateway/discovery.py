"""Announce the gateway on the LAN over mDNS / DNS-SD (python-zeroconf), so that runners find
it with no URL (`runner.discovery`).

The record (`protocol.discovery.Advertisement`) names the gateway, its port, the runner
protocol version and whether a runner token is required; never the token. A gateway that
listens on loopback only is not announced (no runner elsewhere could reach it), nor one
started with `--no-advertise`.
"""

from __future__ import annotations

import ipaddress
import logging

import ifaddr
from zeroconf import IPVersion, ServiceInfo
from zeroconf.asyncio import AsyncZeroconf

from gateway.auth import is_loopback
from protocol.discovery import SERVICE_TYPE, Advertisement

log = logging.getLogger("gateway.discovery")

WILDCARDS = ("", "0.0.0.0", "::")  # noqa: S104 -- recognising them, not binding
"""Hosts that mean "every interface"."""


def addresses_for(host: str) -> list[str]:
    """The addresses a gateway listening on `host` can be reached at: every non-loopback
    IPv4 address of this machine for a wildcard host, else `host` itself."""
    if host not in WILDCARDS:
        return [host]
    found = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and not ipaddress.ip_address(ip.ip).is_loopback:
                found.append(ip.ip)
    return found


class Advertiser:
    """The gateway's mDNS announcement, from `start` until `close`."""

    def __init__(self, advertisement: Advertisement) -> None:
        self.advertisement = advertisement
        self._zeroconf: AsyncZeroconf | None = None
        self._info: ServiceInfo | None = None

    async def start(self) -> None:
        ad = self.advertisement
        self._info = ServiceInfo(
            SERVICE_TYPE,
            ad.instance,
            port=ad.port,
            properties=ad.properties(),
            parsed_addresses=list(ad.addresses),
            # A host name of its own: two gateways on one machine (or in two network
            # namespaces of one) must not claim the same name with different addresses.
            server=f"orchard-{ad.instance.split('.')[0]}-{ad.port}.local.",
        )
        self._zeroconf = AsyncZeroconf(ip_version=IPVersion.V4Only)
        # allow_name_change: a second gateway with the same name gets "name (2)" rather
        # than an error; runners show both.
        await self._zeroconf.async_register_service(self._info, allow_name_change=True)
        log.info(
            "announced on the LAN (mDNS %s) as %r at %s, port %d",
            SERVICE_TYPE,
            ad.name,
            ", ".join(ad.addresses),
            ad.port,
        )

    async def close(self) -> None:
        zeroconf, self._zeroconf = self._zeroconf, None
        if zeroconf is None:
            return
        if self._info is not None:
            await zeroconf.async_unregister_service(self._info)
        await zeroconf.async_close()


def advertiser_for(
    *,
    name: str,
    host: str,
    port: int,
    protocol_version: int,
    token_required: bool,
    enabled: bool,
    tls: bool = False,
) -> Advertiser | None:
    """The gateway's advertiser, or None: turned off, or listening on loopback only."""
    if not enabled:
        return None
    if is_loopback(host):
        log.info("listening on loopback only: not announced on the LAN")
        return None
    addresses = addresses_for(host)
    if not addresses:
        log.warning("no LAN address to announce for host %s: not announced", host)
        return None
    advertisement = Advertisement(
        name, port, protocol_version, token_required, tuple(addresses), tls
    )
    return Advertiser(advertisement)
