"""`GET /v1/runner/proof`: the gateway's answer to a runner that has not trusted it yet; and
the certificate authority's fingerprint in `/health`."""

from __future__ import annotations

from pathlib import Path

import attrs
from litestar.testing import TestClient

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.tls import (
    authority_fingerprint,
    certificate_fingerprint,
    ensure_certificate,
    served_chain,
)
from protocol.pinning import PROOF_PATH, proof

NONCE = "0123456789abcdef0123"
SHOWN = "AA:BB:CC"


def test_a_tls_gateway_proves_the_token_for_its_certificate() -> None:
    app = create_app(
        GatewayConfig(runner_token="t", tls_fingerprint=SHOWN, api_keys=frozenset({"k"}))
    )
    with TestClient(app) as client:
        # No API key needed: the runner has none, and the answer needs the runner token.
        answer = client.get(PROOF_PATH, params={"nonce": NONCE})
        assert answer.status_code == 200
        assert answer.json() == {"fingerprint": SHOWN, "proof": proof("t", NONCE, SHOWN)}
        for nonce in ("", "short", "x" * 129):
            assert client.get(PROOF_PATH, params={"nonce": nonce}).status_code == 400
        # /health names the certificate too, for people checking what they trust.
        assert client.get("/health").json()["tls_fingerprint"] == SHOWN


def test_the_proof_is_for_the_leaf_served_and_comes_with_its_chain(tmp_path: Path) -> None:
    cert, _ = ensure_certificate(tmp_path, ["127.0.0.1"])
    chain, leaf, ca = served_chain(cert), certificate_fingerprint(cert), authority_fingerprint(cert)
    config = GatewayConfig(runner_token="t", tls_fingerprint=ca, tls_chain=chain)
    with TestClient(create_app(config)) as client:
        answer = client.get(PROOF_PATH, params={"nonce": NONCE}).json()
        assert answer == {
            "fingerprint": leaf,
            "chain": list(chain),
            "proof": proof("t", NONCE, leaf),
        }
        # /health names the authority: what clients trust and runners pin, whatever the leaf.
        assert client.get("/health").json()["tls_fingerprint"] == ca
    # Without a runner token there is nothing to prove; the chain is public all the same.
    with TestClient(create_app(attrs.evolve(config, runner_token=None))) as client:
        answer = client.get(PROOF_PATH, params={"nonce": NONCE}).json()
        assert answer == {"fingerprint": leaf, "chain": list(chain)}


def test_without_tls_there_is_no_proof() -> None:
    with TestClient(create_app(GatewayConfig(runner_token="t"))) as client:
        assert client.get(PROOF_PATH, params={"nonce": NONCE}).status_code == 404
    with TestClient(create_app(GatewayConfig())) as client:
        assert "tls_fingerprint" not in client.get("/health").json()
