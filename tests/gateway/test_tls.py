"""The gateway's certificates (gateway/tls.py): a local authority made once and kept, and a
serving certificate it issues for exactly the current names, again when they change."""

from __future__ import annotations

import datetime
import socket
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from gateway import tls
from protocol.pinning import fingerprint
from tests.certificates import old_self_signed

HOST = "studio"
FIRST, MOVED = "192.0.2.10", "198.51.100.7"


@pytest.fixture(autouse=True)
def host_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: f"{HOST}.example.net")


def chain(directory: Path) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates((directory / tls.CERT_FILE).read_bytes())


def authority(directory: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate((directory / tls.CA_FILE).read_bytes())


def names(leaf: x509.Certificate) -> set[str]:
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(name.value) for name in san}


def test_the_authority_is_made_once_and_kept_with_its_key_for_its_owner_only(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "tls"
    tls.ensure_certificate(directory, [FIRST])
    ca, ca_key = (directory / tls.CA_FILE).read_bytes(), (directory / tls.CA_KEY_FILE).read_bytes()
    tls.ensure_certificate(directory, [MOVED])
    tls.ensure_certificate(directory, [FIRST, MOVED])
    assert (directory / tls.CA_FILE).read_bytes() == ca
    assert (directory / tls.CA_KEY_FILE).read_bytes() == ca_key
    for key in (tls.CA_KEY_FILE, tls.KEY_FILE):
        assert (directory / key).stat().st_mode & 0o777 == 0o600
    assert directory.stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in directory.iterdir()) == [
        "ca.key",
        "ca.pem",
        "gateway.key",
        "gateway.pem",
    ]


def test_the_authority_signs_certificates_and_nothing_else(tmp_path: Path) -> None:
    tls.ensure_certificate(tmp_path, [FIRST])
    ca = authority(tmp_path)
    ca.verify_directly_issued_by(ca)  # self-signed
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical
    assert (constraints.value.ca, constraints.value.path_length) == (True, 0)
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical
    assert (usage.value.key_cert_sign, usage.value.crl_sign) == (True, True)
    assert not usage.value.digital_signature
    assert not usage.value.key_encipherment
    assert ca.subject.rfc4514_string() == f"CN=Orchard CA {HOST}"
    assert ca.not_valid_after_utc - ca.not_valid_before_utc > datetime.timedelta(days=3649)
    public = ca.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey)
    assert public.curve.name == "secp256r1"


def test_the_leaf_is_issued_by_the_authority_for_exactly_this_machines_names(
    tmp_path: Path,
) -> None:
    cert, key = tls.ensure_certificate(tmp_path, [FIRST])
    assert (cert, key) == (tmp_path / "gateway.pem", tmp_path / "gateway.key")
    leaf, ca = chain(tmp_path)
    assert ca == authority(tmp_path)  # the chain served: the leaf, then the authority
    leaf.verify_directly_issued_by(ca)
    assert names(leaf) == {"localhost", HOST, f"{HOST}.local", "127.0.0.1", FIRST}
    constraints = leaf.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical
    assert constraints.value.ca is False
    usage = leaf.extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical
    assert usage.value.digital_signature
    assert not usage.value.key_cert_sign
    assert not usage.value.crl_sign
    extended = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(extended) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert leaf.subject != ca.subject
    assert leaf.not_valid_after_utc - leaf.not_valid_before_utc <= datetime.timedelta(days=826)
    private = serialization.load_pem_private_key(key.read_bytes(), None)
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    assert private.public_key().public_bytes(*spki) == leaf.public_key().public_bytes(*spki)


def test_the_leaf_is_kept_while_the_names_are_the_same(tmp_path: Path) -> None:
    tls.ensure_certificate(tmp_path, [FIRST])
    kept = (tmp_path / "gateway.pem").read_bytes(), (tmp_path / "gateway.key").read_bytes()
    tls.ensure_certificate(tmp_path, [FIRST, FIRST])
    assert ((tmp_path / "gateway.pem").read_bytes(), (tmp_path / "gateway.key").read_bytes()) == (
        kept
    )


def test_a_new_address_gets_a_new_leaf_from_the_same_authority(tmp_path: Path) -> None:
    tls.ensure_certificate(tmp_path, [FIRST])
    first = chain(tmp_path)[0]
    tls.ensure_certificate(tmp_path, [MOVED])
    leaf, ca = chain(tmp_path)
    assert leaf != first
    assert names(leaf) == {"localhost", HOST, f"{HOST}.local", "127.0.0.1", MOVED}
    assert ca == authority(tmp_path)
    leaf.verify_directly_issued_by(ca)
    # And back, and a new host name: each a new leaf for exactly its names.
    tls.ensure_certificate(tmp_path, [FIRST, MOVED])
    assert names(chain(tmp_path)[0]) == {
        "localhost",
        HOST,
        f"{HOST}.local",
        "127.0.0.1",
        FIRST,
        MOVED,
    }


def test_a_new_host_name_gets_a_new_leaf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tls.ensure_certificate(tmp_path, [FIRST])
    monkeypatch.setattr(socket, "gethostname", lambda: "laptop")
    tls.ensure_certificate(tmp_path, [FIRST])
    assert names(chain(tmp_path)[0]) == {"localhost", "laptop", "laptop.local", "127.0.0.1", FIRST}


def test_a_leaf_near_its_end_or_without_its_key_is_issued_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    days = tls.LEAF_DAYS
    monkeypatch.setattr(tls, "LEAF_DAYS", tls.RENEW_DAYS - 1)
    tls.ensure_certificate(tmp_path, [FIRST])
    short = chain(tmp_path)[0]
    monkeypatch.setattr(tls, "LEAF_DAYS", days)
    tls.ensure_certificate(tmp_path, [FIRST])
    renewed = chain(tmp_path)[0]
    assert renewed != short
    assert renewed.not_valid_after_utc - short.not_valid_after_utc > datetime.timedelta(days=700)
    # A key that is not the leaf's (a crash between the two files, a hand edit).
    (tmp_path / "gateway.key").unlink()
    tls.ensure_certificate(tmp_path, [FIRST])
    assert chain(tmp_path)[0] != renewed


def test_an_authority_without_its_key_is_not_replaced_silently(tmp_path: Path) -> None:
    tls.ensure_certificate(tmp_path, [FIRST])
    (tmp_path / "ca.key").unlink()
    with pytest.raises(FileNotFoundError, match=r"ca\.pem has no key beside it"):
        tls.ensure_certificate(tmp_path, [MOVED])


def test_an_old_self_signed_certificate_lends_its_name_and_key_to_the_authority(
    tmp_path: Path,
) -> None:
    old = old_self_signed(tmp_path)
    tls.ensure_certificate(tmp_path, [FIRST])
    ca = authority(tmp_path)
    assert ca.subject == old.subject
    assert ca.public_key() == old.public_key()
    assert ca != old  # re-certified with the key usage strict clients want
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    leaf, served_ca = chain(tmp_path)
    assert served_ca == ca
    # Whoever trusts the old certificate verifies the new leaf by it.
    leaf.verify_directly_issued_by(old)
    assert names(leaf) == {"localhost", HOST, f"{HOST}.local", "127.0.0.1", FIRST}
    # Adopted once: later starts keep that authority.
    tls.ensure_certificate(tmp_path, [MOVED])
    assert authority(tmp_path) == ca


def test_a_serving_certificate_that_is_no_ca_is_not_adopted(tmp_path: Path) -> None:
    tls.ensure_certificate(tmp_path / "first", [FIRST])
    # A leaf (not a CA) as gateway.pem with its key and no authority beside it.
    (tmp_path / "other").mkdir()
    key = (tmp_path / "first" / "gateway.key").read_bytes()
    (tmp_path / "other" / "gateway.key").write_bytes(key)
    (tmp_path / "other" / "gateway.pem").write_bytes(
        chain(tmp_path / "first")[0].public_bytes(serialization.Encoding.PEM)
    )
    tls.ensure_certificate(tmp_path / "other", [FIRST])
    assert authority(tmp_path / "other").subject.rfc4514_string() == f"CN=Orchard CA {HOST}"


def test_fingerprints_chain_and_trust_file(tmp_path: Path) -> None:
    cert, _ = tls.ensure_certificate(tmp_path, [FIRST])
    leaf, ca = chain(tmp_path)
    der = serialization.Encoding.DER
    assert tls.certificate_fingerprint(cert) == fingerprint(leaf.public_bytes(der))
    assert tls.authority_fingerprint(cert) == fingerprint(ca.public_bytes(der))
    assert tls.authority_fingerprint(tmp_path / "ca.pem") == fingerprint(ca.public_bytes(der))
    pem = serialization.Encoding.PEM
    assert tls.served_chain(cert) == (
        leaf.public_bytes(pem).decode(),
        ca.public_bytes(pem).decode(),
    )
    assert tls.trust_file(cert) == tmp_path / "ca.pem"
    # An operator's own certificate is trusted as it is.
    own = tmp_path / "own" / "gateway.pem"
    own.parent.mkdir()
    own.write_bytes(leaf.public_bytes(pem))
    assert tls.trust_file(own) == own
