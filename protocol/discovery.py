"""How a gateway announces itself on the LAN (mDNS / DNS-SD), as data: no sockets here.

A gateway registers one service of type `SERVICE_TYPE`, its instance named after the gateway,
on its port, with a TXT record of:

    name      the gateway's name (what `orchard runner --gateway NAME` asks for)
    version   the runner protocol version it speaks (`frames.PROTOCOL_VERSION`)
    token     "required" when runners must present a runner token, else "none"
    tls       "1" when it serves HTTPS / WSS, else "0"

The token itself never goes in the record. `Advertisement` is both what the gateway
publishes and what a runner reads back (`Advertisement.parse`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence

import attrs

from protocol.errors import AdvertisementError

SERVICE_TYPE = "_orchard._tcp.local."
"""The DNS-SD service type of Orchard gateways."""


@attrs.frozen
class Advertisement:
    """One gateway as mDNS announces it."""

    name: str
    port: int
    protocol_version: int
    token_required: bool
    addresses: tuple[str, ...] = ()
    """Its IP addresses (what the gateway listens on, or what a browser resolved)."""
    tls: bool = False
    """It serves HTTPS / WSS (runners then pin its certificate: `protocol.pinning`)."""

    @property
    def instance(self) -> str:
        """The DNS-SD instance name: the gateway's name (dots would split the label)."""
        return f"{self.name.replace('.', '-')}.{SERVICE_TYPE}"

    def properties(self) -> dict[str, str]:
        """The TXT record."""
        return {
            "name": self.name,
            "version": str(self.protocol_version),
            "token": "required" if self.token_required else "none",
            "tls": "1" if self.tls else "0",
        }

    @classmethod
    def parse(
        cls, port: int, addresses: Sequence[str], properties: Mapping[bytes, bytes | None]
    ) -> Advertisement:
        """What a browser resolved, back as an advertisement; `AdvertisementError` when it is
        not an Orchard gateway's record."""
        text = {
            key.decode("utf-8", "replace"): (value or b"").decode("utf-8", "replace")
            for key, value in properties.items()
        }
        name, version, needs = text.get("name"), text.get("version"), text.get("token")
        if not name or version is None or needs not in ("required", "none"):
            raise AdvertisementError(f"not an Orchard gateway's TXT record: {sorted(text)}")
        if not version.isdigit():
            raise AdvertisementError(f"gateway {name!r} announces protocol version {version!r}")
        if not addresses or not 0 < port < 65536:
            raise AdvertisementError(f"gateway {name!r} announces no address to reach it at")
        tls = text.get("tls") == "1"
        return cls(name, port, int(version), needs == "required", tuple(addresses), tls)

    def url(self) -> str:
        """The gateway's base URL at its first address (IPv4 before IPv6)."""
        first = sorted(self.addresses, key=lambda a: ipaddress.ip_address(a).version)[0]
        host = f"[{first}]" if ipaddress.ip_address(first).version == 6 else first
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def describe(self) -> str:
        """One line for a person choosing between gateways."""
        token = "runner token required" if self.token_required else "no runner token"
        return (
            f"{self.name}  {self.url()}  protocol {self.protocol_version}, {token}"
            f"  (--gateway {self.name})"
        )
