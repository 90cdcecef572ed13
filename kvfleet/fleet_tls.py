"""A throwaway certificate authority for `kvfleet up --tls`: the CA and every service's certificate.

Role: `issue_fleet_certificates` creates a CA and, for each service, a key and a certificate
the CA signs, with the names peers verify (kvfleet.runtime.tls): the service's role
(`kvfleet-engine`, ...), its own name (an engine's id: routers check it against the id the
engine claims in Redis), `localhost` and the fleet's host address. Files are PEM under one
directory: `ca.pem`, `<name>.pem`, `<name>.key` (keys 0600).

Why throwaway: a local fleet needs no PKI; the CA's private key is never written anywhere
(it lives in this process only while issuing), so nothing outside the run can mint a
certificate the fleet trusts, and a new run gets a new CA. Keys are ECDSA P-256 (fast to
make, accepted by gRPC's BoringSSL and uvicorn's OpenSSL).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Long enough for any local run; a new `kvfleet up` makes a new CA anyway.
VALIDITY = datetime.timedelta(days=30)
# Clocks of processes on one machine agree, but a CA "from the future" by a second fails.
BACKDATE = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class ServiceCertificate:
    cert_file: Path
    key_file: Path


@dataclass(frozen=True)
class FleetCertificates:
    ca_file: Path
    services: Mapping[str, ServiceCertificate]

    def flags(self, name: str) -> list[str]:
        """The service's --tls-* flags."""
        cert = self.services[name]
        return ["--tls-cert-file", str(cert.cert_file), "--tls-key-file", str(cert.key_file),
                "--tls-ca-file", str(self.ca_file)]


def issue_fleet_certificates(
    directory: Path, names: Mapping[str, Sequence[str]], host: str = "127.0.0.1"
) -> FleetCertificates:
    """A new CA and one certificate per entry of `names` (service name -> extra DNS names)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvfleet throwaway CA")])
    now = datetime.datetime.now(datetime.UTC)
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    ca_file = directory / "ca.pem"
    ca_file.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    services = {
        name: _issue(directory, name, [name, *extra], host, ca_key, ca_cert, now)
        for name, extra in names.items()
    }
    return FleetCertificates(ca_file, services)


def _issue(
    directory: Path, name: str, dns_names: Sequence[str], host: str,
    ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, now: datetime.datetime,
) -> ServiceCertificate:
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dict.fromkeys([*dns_names,
                                                                            "localhost"])]
    try:
        sans.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
    except ValueError:
        sans.append(x509.DNSName(host))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        _builder(subject, ca_cert.subject, key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        # Each service is a server to some peers and a client of others.
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                              ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_file = directory / f"{name}.pem"
    key_file = directory / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return ServiceCertificate(cert_file, key_file)


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey,
    now: datetime.datetime,
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + VALIDITY)
    )
