"""The runner's choice among the gateways it found (the LAN itself: tests/e2e/test_lan.py)."""

from __future__ import annotations

import pytest

from gateway.discovery import addresses_for, advertiser_for
from protocol.discovery import Advertisement
from runner.discovery import choose
from runner.errors import AmbiguousGateway

STUDIO = Advertisement("studio", 8000, 2, True, ("192.168.1.10",))
AIR = Advertisement("air", 8000, 2, False, ("192.168.1.11",))


def test_the_only_gateway_is_joined_and_none_means_keep_looking() -> None:
    assert choose([STUDIO], None) is STUDIO
    assert choose([], None) is None


def test_a_named_gateway_is_picked_among_several_or_waited_for() -> None:
    assert choose([STUDIO, AIR], "air") is AIR
    assert choose([STUDIO], "air") is None


def test_several_unnamed_gateways_are_listed_for_the_operator() -> None:
    with pytest.raises(AmbiguousGateway) as raised:
        choose([STUDIO, AIR], None)
    assert str(raised.value) == (
        "2 gateways answer on this network:\n"
        "  air  http://192.168.1.11:8000  protocol 2, no runner token  (--gateway air)\n"
        "  studio  http://192.168.1.10:8000  protocol 2, runner token required"
        "  (--gateway studio)\n"
        "Choose one with --gateway NAME (or give its URL)."
    )


def test_the_gateway_is_announced_only_off_loopback_and_when_allowed() -> None:
    def advertiser(host: str, *, enabled: bool = True) -> object:
        return advertiser_for(
            name="g", host=host, port=8000, protocol_version=2, token_required=True, enabled=enabled
        )

    assert advertiser("127.0.0.1") is None
    assert advertiser("localhost") is None
    assert advertiser("192.168.1.10", enabled=False) is None
    found = advertiser_for(
        name="g",
        host="192.168.1.10",
        port=8000,
        protocol_version=2,
        token_required=True,
        enabled=True,
    )
    assert found is not None
    assert found.advertisement == Advertisement("g", 8000, 2, True, ("192.168.1.10",))
    # Every interface: this machine's addresses, loopback left out.
    assert "127.0.0.1" not in addresses_for("0.0.0.0")
