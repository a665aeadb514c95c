"""The proof a TLS gateway gives a runner before the runner sends its token."""

from __future__ import annotations

import hashlib
import hmac

from protocol.pinning import fingerprint, proof, proves

DER = b"a certificate"
SHOWN = fingerprint(DER)


def test_the_fingerprint_is_openssls_sha256_form() -> None:
    digest = hashlib.sha256(DER).hexdigest().upper()
    assert SHOWN.replace(":", "") == digest
    assert len(SHOWN) == 32 * 3 - 1
    assert all(len(pair) == 2 for pair in SHOWN.split(":"))


def test_the_proof_binds_the_token_the_nonce_and_the_certificate() -> None:
    answer = proof("token", "nonce-1", SHOWN)
    expected = hmac.new(b"token", f"orchard-tls-proof\nnonce-1\n{SHOWN}".encode(), "sha256")
    assert answer == expected.hexdigest()
    assert proves("token", "nonce-1", SHOWN, answer)
    # Another token (an impostor), another nonce (a replay), another certificate (a man in
    # the middle showing its own): refused.
    assert not proves("other", "nonce-1", SHOWN, answer)
    assert not proves("token", "nonce-2", SHOWN, answer)
    assert not proves("token", "nonce-1", fingerprint(b"another certificate"), answer)
