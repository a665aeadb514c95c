"""Gateway start-up (orchard.gateway_start) as `orchard gateway` runs it: TLS on off loopback,
with a certificate from the kept local authority, and the fingerprint and chain it serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gateway.config import GatewayConfig
from gateway.tls import certificate_fingerprint, served_chain
from orchard import cli, gateway_start


def test_tls_is_on_off_loopback_with_a_kept_certificate(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    served: list[tuple[GatewayConfig, Any]] = []

    async def run_gateway(config: GatewayConfig, log_level: str, **options: Any) -> None:
        served.append((config, options["tls"]))

    monkeypatch.setattr(gateway_start, "run_gateway", run_gateway)
    monkeypatch.setenv("ORCHARD_RUNNER_TOKEN", "t")
    monkeypatch.setenv("ORCHARD_TLS_DIR", str(tmp_path))
    for args in (
        [],
        ["--host", "0.0.0.0"],
        ["--host", "0.0.0.0", "--no-tls"],
        ["--tls"],
    ):
        result = CliRunner().invoke(cli.main, ["gateway", *args])
        assert result.exit_code == 0, result.output
    plain, lan, opted_out, loopback_tls = served
    assert (plain[1], opted_out[1]) == (None, None)
    assert plain[0].tls_fingerprint is None
    cert, key = tmp_path / "gateway.pem", tmp_path / "gateway.key"
    assert lan[1] == loopback_tls[1] == (cert, key)  # the same files, kept or issued again
    # Each start serves the authority's fingerprint and the chain issued for its addresses.
    assert lan[0].tls_fingerprint == loopback_tls[0].tls_fingerprint
    assert lan[0].tls_fingerprint == certificate_fingerprint(tmp_path / "ca.pem")
    assert loopback_tls[0].tls_chain == served_chain(cert)
    result = CliRunner().invoke(cli.main, ["gateway", "--tls-cert", str(cert)])
    assert result.exit_code == 2
    assert "--tls-cert and --tls-key go together" in result.output
