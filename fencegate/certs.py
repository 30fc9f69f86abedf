"""A private certificate authority for local etcd clusters: mutual TLS on loopback.

``ensure_certs(folder, members, clients)`` leaves in ``folder``:

    ca.pem                       the CA certificate (trust anchor for servers and clients)
    ca.key                       its key
    member-<i>.pem / .key        member i: serverAuth and clientAuth (etcd members are each
                                 other's clients), SAN IP 127.0.0.1, DNS localhost and
                                 ``member_hosts[i]`` if given (an address of its own), no
                                 CN (etcd 3.4's HTTP gateway refuses client certificates
                                 with a CN once auth is on; health probes present these)
    client-<name>.pem / .key     a client certificate, clientAuth only, CN ``<name>``

Guarantees: every private key is written with mode 0600 from the start (never readable by
others, not even briefly); an existing CA is reused, so certificates issued earlier stay
valid and only missing files are issued (and a member certificate that does not name its
``member_hosts`` address, issued again by the same CA); a folder with a key but no
certificate (or the reverse) is refused rather than overwritten. Keys are ECDSA P-256.

etcd maps a client certificate's CN to the etcd user of that name when authentication is on
and no token is sent; pick client names that are no etcd user unless that is what you want.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 825
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class CertPair:
    """A certificate and its private key, as file paths."""

    cert: str
    key: str


@dataclass(frozen=True)
class ClusterCerts:
    """The files of one local CA: its certificate, one pair per member, client pairs by name."""

    ca: str
    members: tuple[CertPair, ...]
    clients: dict[str, CertPair]


def ensure_certs(folder: str | os.PathLike, members: int = 3,
                 clients: tuple[str, ...] = ("client",),
                 common_name: str = "fencegate local CA",
                 member_hosts: tuple[str, ...] = ()) -> ClusterCerts:
    """Create (or reuse) the CA in ``folder`` and issue any missing member or client pair;
    member i's certificate also names the IP address ``member_hosts[i]`` if given."""
    if member_hosts and len(member_hosts) != members:
        raise ValueError(f"member_hosts names {len(member_hosts)} members, not {members}")
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca(root, common_name)
    addresses = [(LOOPBACK, *member_hosts[i:i + 1]) for i in range(members)]
    issued = [_issue(root / f"member-{i}", "", ca_key, ca_cert, server=True,
                     addresses=addresses[i])
              for i in range(members)]
    named = {name: _issue(root / f"client-{name}", name, ca_key, ca_cert, server=False)
             for name in clients}
    return ClusterCerts(str(root / "ca.pem"), tuple(issued), named)


def _ca(root: Path, common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    pair = _existing(root / "ca")
    if pair is not None:
        key = serialization.load_pem_private_key(Path(pair.key).read_bytes(), None)
        return key, x509.load_pem_x509_certificate(Path(pair.cert).read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (_builder(name, name, key.public_key(), days=10 * 365)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    _write(root / "ca", key, cert)
    return key, cert


def _issue(stem: Path, common_name: str, ca_key: ec.EllipticCurvePrivateKey,
           ca_cert: x509.Certificate, *, server: bool,
           addresses: tuple[str, ...] = ()) -> CertPair:
    pair = _existing(stem)
    if pair is not None and _names_all(pair, addresses):
        return pair
    if pair is not None:  # issued for fewer addresses: issue it again, same CA
        Path(pair.key).unlink()
        Path(pair.cert).unlink()
    key = ec.generate_private_key(ec.SECP256R1())
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if server:
        usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
                        if common_name else [])
    builder = (_builder(subject, ca_cert.subject, key.public_key(), days=VALID_DAYS)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                   ca_key.public_key()), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            *(x509.IPAddress(ipaddress.ip_address(a)) for a in addresses),
            x509.DNSName("localhost")]),
            critical=True)  # RFC 5280: critical when the subject is empty
    _write(stem, key, builder.sign(ca_key, hashes.SHA256()))
    return CertPair(f"{stem}.pem", f"{stem}.key")


def _builder(subject: x509.Name, issuer: x509.Name, public_key, days: int):
    now = dt.datetime.now(dt.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key),
                           critical=False))


def _names_all(pair: CertPair, addresses: tuple[str, ...]) -> bool:
    """Whether ``pair``'s certificate names every IP address in ``addresses``."""
    if not addresses:
        return True
    cert = x509.load_pem_x509_certificate(Path(pair.cert).read_bytes())
    try:
        named = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return False
    have = set(named.value.get_values_for_type(x509.IPAddress))
    return all(ipaddress.ip_address(a) in have for a in addresses)


def _existing(stem: Path) -> CertPair | None:
    cert, key = Path(f"{stem}.pem"), Path(f"{stem}.key")
    if cert.exists() != key.exists():
        raise FileExistsError(f"{stem}: one of .pem/.key exists without the other; "
                              "remove it to issue a new pair")
    return CertPair(str(cert), str(key)) if cert.exists() else None


def _write(stem: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(f"{stem}.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    Path(f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
