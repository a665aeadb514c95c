"""A runner pins the gateway's certificate authority (runner/pinning.py) over real TLS sockets:
a leaf the authority issues again is trusted, another authority is refused, and so is a leaf
the chain it comes with did not sign.

The gateway here is a small TLS server answering the proof as gateway/admin.py does, with
certificates from gateway/tls.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import orjson
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from gateway.tls import ensure_certificate, served_chain
from protocol.pinning import fingerprint, proof
from runner.errors import UntrustedGateway
from runner.pinning import authority, pinned_context, same_authority
from tests.certificates import old_self_signed

TOKEN = "pinning-token"
DER = serialization.Encoding.DER


def der(pem: str) -> bytes:
    return x509.load_pem_x509_certificate(pem.encode()).public_bytes(DER)


@contextlib.asynccontextmanager
async def gateway(
    cert: Path, key: Path, chain: tuple[str, ...] | None = None, token: str | None = TOKEN
) -> AsyncIterator[str]:
    """A TLS server with `cert` answering the proof for its leaf, with `chain` (the file's
    own unless told; None: none, as before the authority); its URL."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    served = served_chain(cert)
    shown = fingerprint(der(served[0]))
    said = served if chain is None else chain

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ssl.SSLError):
            line = await reader.readline()
            if line:
                nonce = parse_qs(urlsplit(line.split()[1].decode()).query)["nonce"][0]
                body: dict[str, object] = {"fingerprint": shown}
                if said:
                    body["chain"] = list(said)
                if token is not None:
                    body["proof"] = proof(token, nonce, shown)
                payload = orjson.dumps(body)
                writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + payload)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=context)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"wss://127.0.0.1:{port}/v1/runner/ws"
    finally:
        server.close()
        await server.wait_closed()


async def handshake(url: str, context: ssl.SSLContext) -> None:
    """A TLS connection to `url` verified by `context`: what the runner's WebSocket does."""
    parts = urlsplit(url)
    _, writer = await asyncio.open_connection(parts.hostname, parts.port, ssl=context)
    writer.close()


@pytest.fixture(autouse=True)
def no_system_trust(monkeypatch: pytest.MonkeyPatch) -> None:
    # The test certificates are in no system store anyway; an SSL_CERT_FILE must not add one.
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)


async def test_the_pinned_authority_trusts_a_reissued_leaf(tmp_path: Path) -> None:
    cert, key = ensure_certificate(tmp_path, ["127.0.0.1"])
    root = der((tmp_path / "ca.pem").read_text())
    async with gateway(cert, key) as url:
        trust = await pinned_context(url, TOKEN)
    assert trust.root == root
    assert trust.authority == fingerprint(root)
    first_leaf = served_chain(cert)[0]
    # The gateway starts again on another address: a new leaf from the same authority.
    cert, key = ensure_certificate(tmp_path, ["127.0.0.1", "192.0.2.10"])
    assert served_chain(cert)[0] != first_leaf
    async with gateway(cert, key) as url:
        await handshake(url, trust.context)  # the pinned context verifies it as it is
        again = await pinned_context(url, TOKEN, trust.root)  # and asked again, the same
    assert again.root == root


async def test_another_authority_is_refused_with_how_to_re_pin(tmp_path: Path) -> None:
    cert, key = ensure_certificate(tmp_path / "first", ["127.0.0.1"])
    async with gateway(cert, key) as url:
        trust = await pinned_context(url, TOKEN)
    # The TLS directory replaced: another authority, though the gateway knows the token.
    cert, key = ensure_certificate(tmp_path / "replaced", ["127.0.0.1"])
    async with gateway(cert, key) as url:
        with pytest.raises(ssl.SSLCertVerificationError):
            await handshake(url, trust.context)
        with pytest.raises(UntrustedGateway) as refused:
            await pinned_context(url, TOKEN, trust.root)
    new = fingerprint(der((tmp_path / "replaced" / "ca.pem").read_text()))
    assert str(refused.value) == (
        f"the gateway's certificate authority changed: the gateway at {urlsplit(url).netloc} "
        f"shows the authority {new}, not {trust.authority}, which this runner pinned. Its TLS "
        "directory was replaced, or this is not the gateway. The token was not sent. If the "
        "gateway's start-up log names this new authority, re-pin it by restarting the runner."
    )


async def test_a_runner_without_a_token_keeps_its_first_authority(tmp_path: Path) -> None:
    cert, key = ensure_certificate(tmp_path / "first", ["127.0.0.1"])
    async with gateway(cert, key, token=None) as url:
        trust = await pinned_context(url, None)
    cert, key = ensure_certificate(tmp_path / "other", ["127.0.0.1"])
    async with gateway(cert, key, token=None) as url:
        with pytest.raises(UntrustedGateway, match="certificate authority changed") as refused:
            await pinned_context(url, None, trust.root)
    assert "The token was not sent" not in str(refused.value)


async def test_a_leaf_the_chain_did_not_sign_is_refused(tmp_path: Path) -> None:
    # A man in the middle who knows the token still cannot pass off its own leaf with the
    # real gateway's chain: the runner checks the signature before pinning the root.
    real, _ = ensure_certificate(tmp_path / "real", ["127.0.0.1"])
    cert, key = ensure_certificate(tmp_path / "mitm", ["127.0.0.1"])
    mitm_leaf = served_chain(cert)[0]
    async with gateway(cert, key, chain=(mitm_leaf, served_chain(real)[1])) as url:
        with pytest.raises(UntrustedGateway) as refused:
            await pinned_context(url, TOKEN)
    assert str(refused.value) == (
        f"the certificate the gateway at {urlsplit(url).netloc} showed is not issued by the "
        "authority it names (a signature does not verify). The token was not sent."
    )
    # Nor with the real chain as it is: its first certificate is not the one shown.
    async with gateway(cert, key, chain=served_chain(real)) as url:
        with pytest.raises(UntrustedGateway, match="its first certificate is not the one shown"):
            await pinned_context(url, TOKEN)


async def test_a_gateway_from_before_the_authority_is_pinned_by_its_certificate_and_migrates(
    tmp_path: Path,
) -> None:
    old = old_self_signed(tmp_path)
    old_der = old.public_bytes(DER)
    # Before the upgrade: one self-signed certificate and no chain.
    async with gateway(tmp_path / "gateway.pem", tmp_path / "gateway.key", chain=()) as url:
        trust = await pinned_context(url, TOKEN)
    assert trust.root == old_der
    # The gateway upgraded: its old key is now its authority's, which issues the leaf.
    cert, key = ensure_certificate(tmp_path, ["127.0.0.1"])
    async with gateway(cert, key) as url:
        await handshake(url, trust.context)  # what the runner pinned still verifies it
        again = await pinned_context(url, TOKEN, trust.root)  # and asked again, the same
    new_root = der((tmp_path / "ca.pem").read_text())
    assert again.root == new_root != old_der
    assert same_authority(new_root, old_der)


def test_the_authority_of_a_chain() -> None:
    leaf = b"not even a certificate"
    assert authority(leaf, None, "here") == leaf  # no chain: the leaf is its own root
    for chain in ([], "x", [1], ["not PEM"]):
        with pytest.raises(UntrustedGateway, match="is not issued by the authority it names"):
            authority(leaf, chain, "here")
