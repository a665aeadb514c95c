"""The gateway's mDNS record, as data: what it publishes and what a runner reads back."""

from __future__ import annotations

import pytest

from protocol.discovery import SERVICE_TYPE, Advertisement
from protocol.errors import AdvertisementError

AD = Advertisement("studio.lan", 8000, 2, True, ("192.168.1.10",))


def test_the_record_names_the_gateway_and_never_a_token() -> None:
    assert AD.instance == f"studio-lan.{SERVICE_TYPE}"
    assert AD.properties() == {
        "name": "studio.lan",
        "version": "2",
        "token": "required",
        "tls": "0",
    }
    open_one = Advertisement("air", 8000, 2, False, ("10.0.0.2",))
    assert open_one.properties()["token"] == "none"


def test_a_resolved_record_reads_back_as_published() -> None:
    raw = {key.encode(): value.encode() for key, value in AD.properties().items()}
    assert Advertisement.parse(8000, ["192.168.1.10"], raw) == AD
    assert AD.url() == "http://192.168.1.10:8000"
    assert AD.describe() == (
        "studio.lan  http://192.168.1.10:8000  protocol 2, runner token required"
        "  (--gateway studio.lan)"
    )


def test_a_tls_gateway_is_reached_over_https_and_an_old_record_means_plain_http() -> None:
    secure = Advertisement("studio", 8000, 2, True, ("192.168.1.10",), tls=True)
    assert secure.properties()["tls"] == "1"
    raw = {key.encode(): value.encode() for key, value in secure.properties().items()}
    assert Advertisement.parse(8000, ["192.168.1.10"], raw) == secure
    assert secure.url() == "https://192.168.1.10:8000"
    del raw[b"tls"]
    assert Advertisement.parse(8000, ["192.168.1.10"], raw).url() == "http://192.168.1.10:8000"


def test_ipv4_comes_first_and_ipv6_is_bracketed() -> None:
    both = Advertisement("x", 9000, 2, False, ("fe80::1", "10.1.2.3"))
    assert both.url() == "http://10.1.2.3:9000"
    assert Advertisement("x", 9000, 2, False, ("fe80::1",)).url() == "http://[fe80::1]:9000"


@pytest.mark.parametrize(
    ("port", "addresses", "properties", "message"),
    [
        (8000, ["10.0.0.1"], {b"version": b"2", b"token": b"none"}, "not an Orchard gateway"),
        (8000, ["10.0.0.1"], {b"name": b"g", b"token": b"none"}, "not an Orchard gateway"),
        (8000, ["10.0.0.1"], {b"name": b"g", b"version": b"2", b"token": b"x"}, "not an Orchard"),
        (8000, ["10.0.0.1"], {b"name": b"g", b"version": b"two", b"token": b"none"}, "'two'"),
        (8000, [], {b"name": b"g", b"version": b"2", b"token": b"none"}, "no address"),
        (0, ["10.0.0.1"], {b"name": b"g", b"version": b"2", b"token": b"none"}, "no address"),
    ],
)
def test_other_records_are_refused_with_the_reason(
    port: int, addresses: list[str], properties: dict[bytes, bytes | None], message: str
) -> None:
    with pytest.raises(AdvertisementError, match=message):
        Advertisement.parse(port, addresses, properties)
