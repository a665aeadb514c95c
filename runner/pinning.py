"""Trust a gateway's TLS certificate the way `protocol.pinning` says: ask it to prove it knows
the runner token before sending the token, then pin the certificate authority it serves.

A certificate a trusted authority signed (a TLS proxy in front of the gateway) is simply
verified. Otherwise `pinned_context(url, token, pinned)` connects without verifying the
certificate, reads the leaf it is shown, and asks `PROOF_PATH` with a fresh nonce (no token
sent): the answer is the proof for that leaf and the chain the gateway serves (the leaf, then
its authority). The runner checks the proof with its token and the leaf's signature by the
chain up to its root (`authority`), and pins that root: the returned `ssl.SSLContext` trusts
the gateway's own authority only, for the WebSocket the token then travels on. So a leaf the
authority issues again (the gateway's address changed) is still trusted, while a gateway
showing another authority than the `pinned` one is refused. A gateway that cannot prove the
token (an impostor, a man in the middle with its own certificate) raises `UntrustedGateway`.
Without a token there is nothing to prove: the authority is trusted on first use, and its
fingerprint logged.

A gateway from before the authority serves one self-signed certificate and no chain: that
certificate is its own root, pinned as before.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import ssl
from urllib.parse import urlsplit

import attrs
import orjson
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from protocol.pinning import NONCE_BYTES, PROOF_PATH, fingerprint, proves
from runner.errors import UntrustedGateway

log = logging.getLogger("runner.pinning")

TIMEOUT_S = 10.0
RESPONSE_LIMIT = 64 * 1024
"""The most of the proof's HTTP response read (it is a few hundred bytes)."""


@attrs.frozen
class Trust:
    """How a runner trusts its gateway: the TLS context, and what it pinned."""

    context: ssl.SSLContext
    root: bytes | None
    """The pinned certificate authority (DER); None when an authority the system trusts
    verified the gateway (nothing pinned)."""

    @property
    def authority(self) -> str | None:
        """The pinned authority's SHA-256 fingerprint."""
        return None if self.root is None else fingerprint(self.root)


async def pinned_context(url: str, token: str | None, pinned: bytes | None = None) -> Trust:
    """How to reach the gateway at `url` (https:// or wss://), refusing any authority but
    the `pinned` one (DER) when one is (see above)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 443
    trusted = ssl.create_default_context()
    try:  # a certificate from a CA (a TLS proxy in front of the gateway) needs no pinning
        async with asyncio.timeout(TIMEOUT_S):
            _, writer = await asyncio.open_connection(host, port, ssl=trusted)
        writer.close()
        log.info("the gateway's certificate is signed by a trusted authority")
        return Trust(trusted, None)
    except ssl.SSLCertVerificationError:
        pass  # the gateway's own authority: proven with the token, then pinned
    nonce = secrets.token_hex(NONCE_BYTES)
    async with asyncio.timeout(TIMEOUT_S):
        der, body = await _ask(host, port, f"{PROOF_PATH}?nonce={nonce}")
    shown = fingerprint(der)
    answer = _answer(body)
    if token is not None:
        said = answer.get("proof")
        if not isinstance(said, str) or not proves(token, nonce, shown, said):
            raise UntrustedGateway(
                f"the gateway at {host}:{port} did not prove that it knows the runner token "
                f"for the certificate it showed ({shown}): an impostor, or a man in the middle. "
                "The token was not sent."
            )
    root = authority(der, answer.get("chain"), f"{host}:{port}")
    seen = fingerprint(root)
    if pinned is not None and not same_authority(root, pinned):
        raise UntrustedGateway(
            f"the gateway's certificate authority changed: the gateway at {host}:{port} shows "
            f"the authority {seen}, not {fingerprint(pinned)}, which this runner pinned. Its "
            "TLS directory was replaced, or this is not the gateway. "
            + ("The token was not sent. " if token is not None else "")
            + "If the gateway's start-up log names this new authority, re-pin it by "
            "restarting the runner."
        )
    if token is None:
        log.warning(
            "no runner token: trusting the gateway's certificate authority %s as first seen", seen
        )
    elif pinned is None:
        log.info("the gateway proved the runner token; pinned its certificate authority %s", seen)
    else:
        log.info("the gateway proved the runner token; its certificate authority is still %s", seen)
    context = ssl.create_default_context(cadata=ssl.DER_cert_to_PEM_cert(root))
    context.check_hostname = False  # the pinned authority is the identity, whatever the name
    # The root is its own anchor even when it is not self-signed (an operator's chain).
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return Trust(context, root)


def same_authority(root: bytes, pinned: bytes) -> bool:
    """Whether `root` (DER) is the `pinned` authority: the same certificate, or one with the
    same name and key (what verifies a leaf), such as the authority a gateway made from the
    key of its self-signed certificate from before (gateway.tls)."""
    if root == pinned:
        return True
    a, b = x509.load_der_x509_certificate(root), x509.load_der_x509_certificate(pinned)
    return a.subject == b.subject and _key(a) == _key(b)


def _key(certificate: x509.Certificate) -> bytes:
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    return certificate.public_key().public_bytes(serialization.Encoding.DER, spki)


def authority(leaf: bytes, chain: object, where: str) -> bytes:
    """The root (DER) of the `chain` of PEM certificates a gateway said it serves, once the
    `leaf` it showed (DER) is checked to be the chain's first and each certificate to be
    signed by the next; the leaf itself when there is no chain (a gateway from before its
    authority). UntrustedGateway otherwise."""
    if chain is None:
        return leaf
    try:
        if not (isinstance(chain, list) and chain and all(isinstance(c, str) for c in chain)):
            raise ValueError("not a list of PEM certificates")
        certificates = [x509.load_pem_x509_certificate(c.encode()) for c in chain]
        if certificates[0].public_bytes(serialization.Encoding.DER) != leaf:
            raise ValueError("its first certificate is not the one shown")
        for certificate, issuer in itertools.pairwise(certificates):
            certificate.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise UntrustedGateway(
            f"the certificate the gateway at {where} showed is not issued by the authority "
            f"it names ({str(exc) or 'a signature does not verify'}). The token was not sent."
        ) from None
    return certificates[-1].public_bytes(serialization.Encoding.DER)


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


def _answer(body: bytes) -> dict[str, object]:
    """The proof's JSON object; empty when it is not one (the checks then refuse it)."""
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {}
    return answer if isinstance(answer, dict) else {}
