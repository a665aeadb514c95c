"""How a runner trusts a gateway's TLS certificate with no public certificate authority, as data.

The gateway's certificate is issued by its own local authority (gateway/tls.py), which no
system trusts, so a runner cannot check it the usual way. Instead, before it sends its runner
token, it asks the gateway over a TLS connection it does not yet trust to prove that it knows
the token too: `GET PROOF_PATH?nonce=N` answers `proof(token, N, F)`, where F is the
fingerprint of the certificate the gateway serves (the leaf), with the chain it serves (the
leaf, then its authority). The runner computes the same with its own token, its fresh nonce
and the fingerprint of the certificate it was actually shown. They match only if the gateway
knows the token and the certificate is the gateway's own: an impostor (a spoofed mDNS answer)
knows no token, and a man in the middle shows its own certificate, so either is refused
before the token leaves the runner. The runner then checks that the leaf is signed by the
chain's root and connects trusting that authority alone (pinned): a leaf it issues later, for
a new address, is trusted too; another authority is refused.
"""

from __future__ import annotations

import hashlib
import hmac

PROOF_PATH = "/v1/runner/proof"
"""Where a gateway serving TLS proves it knows the runner token."""
NONCE_BYTES = 16


def fingerprint(der: bytes) -> str:
    """A certificate's SHA-256 fingerprint, as `openssl x509 -fingerprint -sha256` prints it."""
    digest = hashlib.sha256(der).hexdigest().upper()
    return ":".join(digest[i : i + 2] for i in range(0, len(digest), 2))


def proof(token: str, nonce: str, certificate: str) -> str:
    """The gateway's answer to `nonce`: an HMAC of the nonce and its certificate's
    fingerprint under the runner token."""
    message = f"orchard-tls-proof\n{nonce}\n{certificate}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def proves(token: str, nonce: str, certificate: str, answer: str) -> bool:
    """Whether `answer` is the proof of a gateway that knows `token` and serves `certificate`."""
    return hmac.compare_digest(proof(token, nonce, certificate), answer)
