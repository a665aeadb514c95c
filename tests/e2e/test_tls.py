"""TLS between runners, clients and a gateway with its own certificate authority
(gateway/tls.py, protocol/pinning.py, runner/pinning.py), over real sockets.

A runner pins the gateway's authority only once the gateway has proven it knows the runner
token; an impostor that does not know it (a spoofed mDNS answer, a man in the middle) is
refused before the token leaves the runner. Clients trust the authority's file, `ca.pem`,
which verifies the gateway at whatever address it starts on next.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.tls import certificate_fingerprint
from tests.support import TLS_TOKEN, UNIT, Process, TlsGateway, wait_until

TOKEN = TLS_TOKEN
MODEL = "tls-model"


def runner(gateway: TlsGateway, name: str, token: str = TOKEN) -> Process:
    args = ["runner", "--gateway", gateway.base, "--name", name, "--engine", "scripted"]
    return Process(
        [*args, "--model", MODEL, "--log-level", "info"], env={"ORCHARD_RUNNER_TOKEN": token}
    )


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[TlsGateway]:
    gw = TlsGateway(tmp_path / "tls")
    yield gw
    gw.process.stop()


def test_a_runner_pins_the_proven_certificate_and_a_client_trusts_the_file(
    gateway: TlsGateway,
) -> None:
    joined = runner(gateway, "pinning")
    try:
        wait_until(lambda: "pinning" in gateway.runners(), 30, "the runner to join over TLS")
        with openai.OpenAI(
            base_url=f"{gateway.base}/v1",
            api_key="unused",
            http_client=openai.DefaultHttpxClient(
                verify=ssl.create_default_context(cafile=str(gateway.ca))
            ),
        ) as client:
            answer = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
        assert answer.choices[0].message.content == "tok0 tok1 tok2 "
        assert answer.usage is not None
        assert answer.usage.completion_tokens == 3
    finally:
        log = joined.stop()
    pinned = certificate_fingerprint(gateway.ca)
    assert f"the gateway proved the runner token; pinned its certificate authority {pinned}" in log
    assert pinned != certificate_fingerprint(gateway.cert)  # the authority, not the leaf
    assert f"registered with wss://127.0.0.1:{gateway.port}" in log, log
    # Plain HTTP to a TLS port gets nothing.
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{gateway.port}/health", timeout=2)


def test_an_impostor_that_does_not_know_the_token_never_sees_it(tmp_path: Path) -> None:
    impostor = TlsGateway(tmp_path / "impostor", token="another-token")
    fooled = runner(impostor, "fooled")
    try:
        fooled.proc.wait(30 * UNIT)
    finally:
        log = fooled.stop()
        seen = impostor.process.stop()
    assert fooled.proc.returncode == 2, log
    assert "did not prove that it knows the runner token" in log, log
    assert "The token was not sent." in log
    # The runner never opened the runner socket: the impostor had nothing to refuse.
    assert "missing or wrong runner token" not in seen, seen
    assert "/v1/runner/ws" not in seen, seen


def test_the_certificate_is_kept_across_restarts(tmp_path: Path) -> None:
    first = TlsGateway(tmp_path / "tls")
    kept = first.ca.read_bytes(), first.cert.read_bytes()
    first.process.stop()
    second = TlsGateway(tmp_path / "tls")
    try:
        assert (second.ca.read_bytes(), second.cert.read_bytes()) == kept  # the same names
        for key in ("ca.key", "gateway.key"):
            assert (tmp_path / "tls" / key).stat().st_mode & 0o077 == 0
    finally:
        second.process.stop()


def test_a_client_trusting_the_authority_verifies_the_gateway_at_a_new_address(
    tmp_path: Path,
) -> None:
    # The gateway starts at one address, then (DHCP, another network) at another, with the
    # same TLS directory: a client that trusts ca.pem verifies it by IP at both.
    directory = tmp_path / "tls"
    first = TlsGateway(directory, host="127.0.0.1")
    try:
        trusted = ssl.create_default_context(cafile=str(first.ca))
        assert httpx.get(f"{first.base}/health", verify=trusted, timeout=5).json()["status"] == "ok"
    finally:
        first.process.stop()
    authority = first.ca.read_bytes()
    second = TlsGateway(directory, host="127.0.0.2")
    try:
        assert second.ca.read_bytes() == authority
        trusted = ssl.create_default_context(cafile=str(second.ca))
        health = httpx.get(f"{second.base}/health", verify=trusted, timeout=5).json()
        assert health["tls_fingerprint"] == certificate_fingerprint(second.ca)
        with openai.OpenAI(
            base_url=f"{second.base}/v1",
            api_key="unused",
            http_client=openai.DefaultHttpxClient(verify=trusted),
        ) as client:
            assert client.models.list().data == []
    finally:
        second.process.stop()
