"""Development TLS material: a throwaway CA, a localhost server cert, a client cert, a token.

``python -m flexmarl.devcerts OUT_DIR`` writes ``ca.pem``, ``server.pem``/``server-key.pem``
(localhost, 127.0.0.1 and ::1; usable as a client certificate too, so daemons can present it to
each other under mutual TLS), ``client.pem``/``client-key.pem`` and ``token``. Private keys and
the token are created with mode 0600. The CA's key is not kept: issue a new set instead. For
development and tests only; production certificates come from the operator's own CA.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path

VALID_DAYS = 30


@dataclasses.dataclass(frozen=True)
class DevCerts:
    """Paths of a generated set."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    token_file: Path

    def daemon_args(self) -> list[str]:
        """The daemon flags that serve TLS with the server cert and require the token."""
        return ["--tls-cert", str(self.server_cert), "--tls-key", str(self.server_key), "--tls-ca", str(self.ca),
                "--auth-token-file", str(self.token_file)]


def _write(path: Path, data: bytes, secret: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(path, flags, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    if secret:
        os.chmod(path, 0o600)  # an existing file keeps its old mode through O_CREAT


def generate(out_dir: Path, *, hosts: Sequence[str] = ("localhost", "127.0.0.1", "::1")) -> DevCerts:
    """Writes a fresh CA, server cert, client cert and token into out_dir (created)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def name(common_name: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "FlexMARL dev"),
                          x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    def builder(subject: str, issuer: x509.Name, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(issuer)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=VALID_DAYS)))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (builder("FlexMARL dev CA", name("FlexMARL dev CA"), ca_key)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, encipher_only=False,
                                            decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))

    def leaf(subject: str, usages: list[x509.ObjectIdentifier], sans: Sequence[str]) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (builder(subject, ca_cert.subject, key)
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
        if sans:
            entries: list[x509.GeneralName] = []
            for host in sans:
                try:
                    entries.append(x509.IPAddress(ipaddress.ip_address(host)))
                except ValueError:
                    entries.append(x509.DNSName(host))
            b = b.add_extension(x509.SubjectAlternativeName(entries), critical=False)
        cert = b.sign(ca_key, hashes.SHA256())
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return cert.public_bytes(serialization.Encoding.PEM), key_pem

    server_pem, server_key = leaf("flexmarl-daemon", [ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH], hosts)
    client_pem, client_key = leaf("flexmarl-client", [ExtendedKeyUsageOID.CLIENT_AUTH], ())
    certs = DevCerts(ca=out_dir / "ca.pem", server_cert=out_dir / "server.pem", server_key=out_dir / "server-key.pem",
                     client_cert=out_dir / "client.pem", client_key=out_dir / "client-key.pem",
                     token_file=out_dir / "token")
    _write(certs.ca, ca_cert.public_bytes(serialization.Encoding.PEM), secret=False)
    _write(certs.server_cert, server_pem, secret=False)
    _write(certs.server_key, server_key, secret=True)
    _write(certs.client_cert, client_pem, secret=False)
    _write(certs.client_key, client_key, secret=True)
    _write(certs.token_file, (secrets.token_urlsafe(32) + "\n").encode(), secret=True)
    return certs


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m flexmarl.devcerts OUT_DIR``: writes a set and prints where (never the token)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m flexmarl.devcerts OUT_DIR", file=sys.stderr)
        return 2
    certs = generate(Path(args[0]))
    for field in dataclasses.fields(certs):
        print(f"{field.name}: {getattr(certs, field.name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
