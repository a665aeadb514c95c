"""The gateway's TLS certificate: generated on first start and kept, or the operator's own.

A generated certificate is self-signed (ECDSA P-256, ten years), names this machine
(`localhost`, its host name, `<host>.local` and every address it listens on), and is kept in
the TLS directory (`gateway.pem`, `gateway.key`, the key readable by its owner only), so
runners that pinned it keep trusting the gateway across restarts. Runners trust it through
`protocol.pinning`; clients trust it by its fingerprint or the file (docs/security.md).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from protocol.pinning import fingerprint

log = logging.getLogger("gateway.tls")

CERT_FILE = "gateway.pem"
KEY_FILE = "gateway.key"


def ensure_certificate(directory: Path, addresses: list[str]) -> tuple[Path, Path]:
    """The certificate and key in `directory`, made now if they are not there yet."""
    cert, key = directory / CERT_FILE, directory / KEY_FILE
    if cert.exists() and key.exists():
        return cert, key
    directory.mkdir(parents=True, exist_ok=True)
    private = ec.generate_private_key(ec.SECP256R1())
    host = socket.gethostname().split(".")[0] or "orchard"
    names: list[x509.GeneralName] = [
        x509.DNSName(name) for name in dict.fromkeys(["localhost", host, f"{host}.local"])
    ]
    for address in dict.fromkeys(["127.0.0.1", *addresses]):
        names.append(x509.IPAddress(ipaddress.ip_address(address)))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"Orchard gateway {host}")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(private, hashes.SHA256())
    )
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    os.chmod(key, 0o600)
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    log.info("made a TLS certificate for this gateway: %s", cert)
    return cert, key


def certificate_fingerprint(cert: Path) -> str:
    """The SHA-256 fingerprint of the (first) certificate in a PEM file."""
    loaded = x509.load_pem_x509_certificate(cert.read_bytes())
    return fingerprint(loaded.public_bytes(serialization.Encoding.DER))


def default_directory() -> Path:
    """Where a generated certificate is kept: $ORCHARD_TLS_DIR, or ~/.orchard/tls."""
    configured = os.environ.get("ORCHARD_TLS_DIR")
    return Path(configured) if configured else Path.home() / ".orchard" / "tls"
