"""Trust a gateway's self-signed TLS certificate the way `protocol.pinning` says: ask it to
prove it knows the runner token before sending the token, then trust exactly the certificate
it proved it for.

A certificate a trusted authority signed (a TLS proxy in front of the gateway) is simply
verified. Otherwise `pinned_context(url, token)` connects without verifying the certificate,
reads the certificate, asks `PROOF_PATH` with a fresh nonce (no token sent), and checks the
answer with the runner's token. Only then does it return an `ssl.SSLContext` trusting that
one certificate, for the WebSocket the token then travels on. A gateway that cannot prove it
(an impostor, a man in the middle with its own certificate) raises `UntrustedGateway`.
Without a token there is nothing to prove: the certificate is trusted on first use, and its
fingerprint is logged.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import ssl
from urllib.parse import urlsplit

import orjson

from protocol.pinning import NONCE_BYTES, PROOF_PATH, fingerprint, proves
from runner.errors import UntrustedGateway

log = logging.getLogger("runner.pinning")

TIMEOUT_S = 10.0
RESPONSE_LIMIT = 64 * 1024
"""The most of the proof's HTTP response read (it is a few hundred bytes)."""


async def pinned_context(url: str, token: str | None) -> ssl.SSLContext:
    """The TLS context to reach the gateway at `url` (https:// or wss://) with (see above)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 443
    trusted = ssl.create_default_context()
    try:  # a certificate from a CA (a TLS proxy in front of the gateway) needs no pinning
        async with asyncio.timeout(TIMEOUT_S):
            _, writer = await asyncio.open_connection(host, port, ssl=trusted)
        writer.close()
        log.info("the gateway's certificate is signed by a trusted authority")
        return trusted
    except ssl.SSLCertVerificationError:
        pass  # self-signed: the gateway proves the token, then its certificate is pinned
    nonce = secrets.token_hex(NONCE_BYTES)
    async with asyncio.timeout(TIMEOUT_S):
        der, body = await _ask(host, port, f"{PROOF_PATH}?nonce={nonce}")
    shown = fingerprint(der)
    if token is None:
        log.warning("no runner token: trusting the gateway's certificate %s as first seen", shown)
    else:
        answer = _proof_in(body)
        if answer is None or not proves(token, nonce, shown, answer):
            raise UntrustedGateway(
                f"the gateway at {host}:{port} did not prove that it knows the runner token "
                f"for the certificate it showed ({shown}): an impostor, or a man in the middle. "
                "The token was not sent."
            )
        log.info("the gateway proved the runner token; pinned its certificate %s", shown)
    context = ssl.create_default_context(cadata=ssl.DER_cert_to_PEM_cert(der))
    context.check_hostname = False  # the pinned certificate is the identity, whatever the name
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return context


async def _ask(host: str, port: int, target: str) -> tuple[bytes, bytes]:
    """GET `target` over TLS without checking the certificate: (the certificate, the body)."""
    insecure = ssl.create_default_context()
    insecure.check_hostname = False
    insecure.verify_mode = ssl.CERT_NONE
    reader, writer = await asyncio.open_connection(host, port, ssl=insecure)
    try:
        tls = writer.get_extra_info("ssl_object")
        der = tls.getpeercert(binary_form=True) if tls is not None else None
        if not der:
            raise UntrustedGateway(f"the gateway at {host}:{port} showed no certificate")
        request = f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
        writer.write(request.encode())
        await writer.drain()
        response = b""
        while len(response) < RESPONSE_LIMIT:  # `Connection: close`: the body ends at EOF
            data = await reader.read(RESPONSE_LIMIT)
            if not data:
                break
            response += data
    finally:
        writer.close()
    _, _, body = response.partition(b"\r\n\r\n")
    return der, body


def _proof_in(body: bytes) -> str | None:
    try:
        answer = orjson.loads(body).get("proof")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return answer if isinstance(answer, str) else None
