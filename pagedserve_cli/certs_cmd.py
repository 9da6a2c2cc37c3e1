"""`pagedserve certs DIR`: development certificates (a CA, the scheduler's, a worker's) and an API key file."""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

SERVER_HOSTS = ("localhost", "127.0.0.1", "scheduler")  # scheduler: the compose service's name
KEY_MODE = 0o600


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("certs", help="write development TLS certificates (CA, scheduler, worker) and an API key file")
    p.add_argument("dir", help="where to write ca.pem, server.pem, server-key.pem, worker.pem, worker-key.pem "
                               "and api-keys")
    p.add_argument("--host", action="append", default=[], metavar="NAME|IP",
                   help="another name or IP address of the scheduler for its certificate (repeatable); "
                        f"{', '.join(SERVER_HOSTS)} are always in it")
    p.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    p.add_argument("--force", action="store_true", help="overwrite files that exist")
    p.set_defaults(func=run)


@dataclass(slots=True)
class Issued:
    """A private key and its certificate (cryptography objects)."""

    key: object
    cert: object

    def cert_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization
        return self.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())


def _subject_alt_names(hosts) -> list:
    from cryptography import x509
    names = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def issue(common_name: str, ca: Issued | None = None, hosts=(), server: bool = False, client: bool = False,
          days: int = 365) -> Issued:
    """A new EC P-256 key and its certificate: a self-signed CA when `ca` is None, else a leaf signed by `ca`
    for `hosts` (subject alternative names), usable by a server and/or a client (extended key usage)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(ca.cert.subject if ca else name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=ca is None, path_length=None), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False))
    if ca is None:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
        return Issued(key, builder.sign(key, hashes.SHA256()))
    usages = [ExtendedKeyUsageOID.SERVER_AUTH] * server + [ExtendedKeyUsageOID.CLIENT_AUTH] * client
    builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False).add_extension(
        x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName(_subject_alt_names(hosts)), critical=False)
    return Issued(key, builder.sign(ca.key, hashes.SHA256()))


def dev_certificates(hosts=(), days: int = 365, ca_name: str = "pagedserve dev CA") -> dict[str, bytes]:
    """File name -> PEM: ca.pem, server.pem and server-key.pem (for SERVER_HOSTS + `hosts`; also valid as a client
    certificate, so `pagedserve up` can hand it to its own workers), worker.pem and worker-key.pem (client only)."""
    ca = issue(ca_name, days=days)
    server = issue("pagedserve scheduler", ca, (*SERVER_HOSTS, *hosts), server=True, client=True, days=days)
    worker = issue("pagedserve worker", ca, client=True, days=days)
    return {"ca.pem": ca.cert_pem(), "server.pem": server.cert_pem(), "server-key.pem": server.key_pem(),
            "worker.pem": worker.cert_pem(), "worker-key.pem": worker.key_pem()}


def api_key_file() -> bytes:
    return (b"# pagedserve API keys: one a line; clients send `authorization: Bearer KEY`\n"
            + secrets.token_urlsafe(32).encode() + b"\n")


def write_private(path: Path, data: bytes) -> None:
    """Writes a file only its owner can read (created with that mode: never readable by others, even briefly)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, KEY_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, KEY_MODE)  # NOTE: O_CREAT's mode does not apply to a file that existed


def run(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    files = {**dev_certificates(args.host, args.days), "api-keys": api_key_file()}
    taken = [name for name in files if (out / name).exists()]
    if taken and not args.force:
        raise ValueError(f"{out}: {', '.join(taken)} exist already (--force overwrites them)")
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        if name.endswith("-key.pem") or name == "api-keys":
            write_private(out / name, data)
        else:
            (out / name).write_bytes(data)
    print(f"wrote {', '.join(files)} to {out}")
    return 0
