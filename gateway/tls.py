"""The gateway's TLS certificates: a local certificate authority made once and kept, and a
serving certificate it issues for this machine's current names; or the operator's own.

Clients and runners trust the authority (`ca.pem`, ECDSA P-256, ten years), which does not
change. The serving certificate (`gateway.pem`: the leaf, then the authority) names
`localhost`, the host name, `<host>.local` and every address the gateway listens on; a start
whose names differ from the kept leaf's (a new LAN address from DHCP, a laptop on another
network), or whose leaf nears its end, issues a new one. Both keys (`ca.key`, `gateway.key`)
are readable by their owner only. Runners pin the authority through `runner.pinning`;
clients trust `ca.pem` (docs/security.md).

A directory from before the authority (one self-signed `gateway.pem`, a CA itself) is
migrated: its key becomes the authority's, under the same name, so whoever trusts the old
certificate (a runner that pinned it, a client's `SSL_CERT_FILE`) also verifies the leaves the
authority now issues.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from protocol.pinning import fingerprint

log = logging.getLogger("gateway.tls")

CA_FILE = "ca.pem"
CA_KEY_FILE = "ca.key"
CERT_FILE = "gateway.pem"
"""The serving chain: the leaf, then the authority."""
KEY_FILE = "gateway.key"

CA_DAYS = 3650
LEAF_DAYS = 825
"""The longest a TLS server certificate may live for Apple's clients (macOS, iOS)."""
RENEW_DAYS = 30
"""A leaf this close to its end is issued again at a start."""

_DER = serialization.Encoding.DER
_PEM = serialization.Encoding.PEM


def ensure_certificate(directory: Path, addresses: list[str]) -> tuple[Path, Path]:
    """The serving chain and its key in `directory`, for `addresses` and this machine's
    names: the kept ones while they fit, else issued now by the kept (or new) authority."""
    cert, key = directory / CERT_FILE, directory / KEY_FILE
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca, ca_key = _authority(directory)
    names = _names(addresses)
    if _fits(cert, key, ca, names):
        return cert, key
    private = ec.generate_private_key(ec.SECP256R1())
    leaf = _issue(ca, ca_key, private, names)
    _write_key(key, private)  # first: a leaf written without its key would not fit
    _write(cert, leaf.public_bytes(_PEM) + ca.public_bytes(_PEM))
    named = ", ".join(sorted(str(name.value) for name in names))
    log.info("issued a TLS certificate for %s: %s", named, cert)
    return cert, key


def served_chain(cert: Path) -> tuple[str, ...]:
    """The certificates in a PEM file, each as PEM: the leaf first, then its issuers."""
    return tuple(
        c.public_bytes(_PEM).decode() for c in x509.load_pem_x509_certificates(cert.read_bytes())
    )


def certificate_fingerprint(cert: Path) -> str:
    """The SHA-256 fingerprint of the first certificate in a PEM file (the leaf)."""
    return _fingerprint(x509.load_pem_x509_certificates(cert.read_bytes())[0])


def authority_fingerprint(cert: Path) -> str:
    """The SHA-256 fingerprint of the last certificate in a PEM file: the root a runner pins
    and a client trusts (the certificate itself when it is alone)."""
    return _fingerprint(x509.load_pem_x509_certificates(cert.read_bytes())[-1])


def trust_file(cert: Path) -> Path:
    """The file a client trusts to verify the chain in `cert`: the kept authority beside a
    generated chain (`ca.pem`), else the file itself (an operator's own)."""
    ca = cert.with_name(CA_FILE)
    if ca.exists() and authority_fingerprint(ca) == authority_fingerprint(cert):
        return ca
    return cert


def default_directory() -> Path:
    """Where generated certificates are kept: $ORCHARD_TLS_DIR, or ~/.orchard/tls."""
    configured = os.environ.get("ORCHARD_TLS_DIR")
    return Path(configured) if configured else Path.home() / ".orchard" / "tls"


Names = frozenset[x509.DNSName | x509.IPAddress]


def _names(addresses: list[str]) -> Names:
    host = _host()
    dns = [x509.DNSName(name) for name in ("localhost", host, f"{host}.local")]
    ips = [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", *addresses)]
    return frozenset([*dns, *ips])


def _host() -> str:
    return socket.gethostname().split(".")[0] or "orchard"


def _authority(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The kept authority and its key; made now (from an old self-signed certificate's key
    when the directory has one) when there is none."""
    ca, ca_key = directory / CA_FILE, directory / CA_KEY_FILE
    if ca.exists():
        if not ca_key.exists():
            raise FileNotFoundError(
                f"{ca} has no key beside it ({ca_key}): restore the key, or remove {ca} to "
                "make a new certificate authority (clients and runners then trust it again)"
            )
        certificate = x509.load_pem_x509_certificate(ca.read_bytes())
        private = serialization.load_pem_private_key(ca_key.read_bytes(), None)
        if not isinstance(private, ec.EllipticCurvePrivateKey) or _public(
            private.public_key()
        ) != _public(certificate.public_key()):
            raise ValueError(f"{ca_key} is not the key of {ca}")
        return certificate, private
    old = _old_self_signed(directory)
    if old is not None:
        subject, private = old
        log.info(
            "adopted the key of the old self-signed %s as the certificate authority", CERT_FILE
        )
    else:
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"Orchard CA {_host()}")])
        private = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(key_cert_sign=True, crl_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(private.public_key()), False)
        .sign(private, hashes.SHA256())
    )
    _write_key(ca_key, private)  # first: an authority without its key cannot issue
    _write(ca, certificate.public_bytes(_PEM))
    log.info("made a TLS certificate authority for this gateway: %s", ca)
    return certificate, private


def _old_self_signed(directory: Path) -> tuple[x509.Name, ec.EllipticCurvePrivateKey] | None:
    """The subject and key of a self-signed CA certificate kept as `gateway.pem` before there
    was an authority, or None. The authority gets both, so what verified the old certificate
    (by its name and key) verifies the leaves it issues."""
    cert, key = directory / CERT_FILE, directory / KEY_FILE
    if not (cert.exists() and key.exists()):
        return None
    try:
        (old,) = x509.load_pem_x509_certificates(cert.read_bytes())
        private = serialization.load_pem_private_key(key.read_bytes(), None)
        constraints = old.extensions.get_extension_for_class(x509.BasicConstraints).value
        old.verify_directly_issued_by(old)
    except (ValueError, TypeError, x509.ExtensionNotFound, InvalidSignature):
        return None
    if not constraints.ca or not isinstance(private, ec.EllipticCurvePrivateKey):
        return None
    if _public(private.public_key()) != _public(old.public_key()):
        return None
    return old.subject, private


def _issue(
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    private: ec.EllipticCurvePrivateKey,
    names: Names,
) -> x509.Certificate:
    """A serving certificate for `names`, issued by the authority: not a CA, for TLS servers.
    Its subject is the host name, never the authority's (an adopted one is "Orchard gateway
    <host>"), so nothing takes it for self-issued."""
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _host())])
    now = datetime.datetime.now(datetime.UTC)
    ordered = sorted(names, key=lambda n: (isinstance(n, x509.IPAddress), str(n.value)))
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.subject)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
        .add_extension(x509.SubjectAlternativeName(ordered), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(digital_signature=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(private.public_key()), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )


def _fits(cert: Path, key: Path, ca: x509.Certificate, names: Names) -> bool:
    """Whether the kept serving chain can be served again: issued by the authority, for
    exactly `names`, far from its end, with its key beside it."""
    try:
        leaf, *issuers = x509.load_pem_x509_certificates(cert.read_bytes())
        private = serialization.load_pem_private_key(key.read_bytes(), None)
        leaf.verify_directly_issued_by(ca)
        named = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, TypeError, x509.ExtensionNotFound, InvalidSignature):
        return False
    left = leaf.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
    return (
        issuers == [ca]
        and frozenset(named) == names
        and left > datetime.timedelta(days=RENEW_DAYS)
        and isinstance(private, ec.EllipticCurvePrivateKey)
        and _public(private.public_key()) == _public(leaf.public_key())
    )


def _usage(
    *, digital_signature: bool = False, key_cert_sign: bool = False, crl_sign: bool = False
) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=key_cert_sign,
        crl_sign=crl_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _public(key: CertificatePublicKeyTypes) -> bytes:
    return key.public_bytes(_DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _fingerprint(certificate: x509.Certificate) -> str:
    return fingerprint(certificate.public_bytes(_DER))


def _write_key(path: Path, private: ec.EllipticCurvePrivateKey) -> None:
    """A private key, readable by its owner only from its first byte."""
    pem = private.private_bytes(
        _PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _write(path, pem, mode=0o600)


def _write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` whole (a crash leaves the old file or the new, never half of one)."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.unlink(missing_ok=True)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    os.chmod(temporary, mode)  # whatever the umask
    os.replace(temporary, path)
