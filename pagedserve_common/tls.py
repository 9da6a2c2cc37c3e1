"""The PEM files named by --tls-* flags, read and checked with errors that name the flag (gRPC makes the
credentials from them: scheduler_svc.auth on the server side, pagedserve_cli.access_args on the client side)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class TlsConfigError(ValueError):
    """A --tls-* flag names a file that cannot be read, or a flag is missing its partner."""


def read_pem(path: str, flag: str) -> bytes:
    """The bytes of a PEM file; the error names the flag that gave the path."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TlsConfigError(f"{flag} {path}: cannot read it: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise TlsConfigError(f"{flag} {path}: not a PEM file (no '-----BEGIN' line)")
    return data


def load_certificates(data: bytes, flag: str, path: str) -> list:
    """The certificates of PEM `data` (cryptography's x509 objects); an error naming `flag` and `path` when it holds
    none that parses. NOTE: gRPC and OpenSSL would only say "Invalid cert chain file" on a log line of their own."""
    from cryptography import x509

    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError as e:
        raise TlsConfigError(f"{flag} {path}: not a valid PEM certificate ({e})") from None


def check_identity(chain: bytes, key: bytes, cert_path: str, key_path: str) -> None:
    """That --tls-key's PEM `key` is an unencrypted private key, of the first certificate of --tls-cert's `chain`."""
    from cryptography.hazmat.primitives import serialization

    certs = load_certificates(chain, "--tls-cert", cert_path)
    try:
        private = serialization.load_pem_private_key(key, password=None)
    except TypeError:  # NOTE: cryptography's word for "it is encrypted, and no password was given"
        raise TlsConfigError(f"--tls-key {key_path}: an encrypted private key: give it unencrypted "
                             f"(`openssl pkey -in KEY -out PLAIN`)") from None
    except (ValueError, cryptography_errors()) as e:
        raise TlsConfigError(f"--tls-key {key_path}: not a valid PEM private key ({e})") from None
    raw = (serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    if private.public_key().public_bytes(*raw) != certs[0].public_key().public_bytes(*raw):
        raise TlsConfigError(f"--tls-key {key_path}: not the private key of the certificate in --tls-cert "
                             f"{cert_path}")


def cryptography_errors() -> type[Exception]:
    from cryptography.exceptions import UnsupportedAlgorithm

    return UnsupportedAlgorithm


@dataclass(slots=True, frozen=True)
class TlsFiles:
    """The paths given by --tls-cert, --tls-key and --tls-ca (None: not given)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            given, missing = ("--tls-cert", "--tls-key") if self.cert else ("--tls-key", "--tls-cert")
            raise TlsConfigError(f"{given} needs {missing} as well (a certificate and its private key)")

    @property
    def has_identity(self) -> bool:
        """Whether a certificate and key were given (server: TLS on; worker: a client certificate)."""
        return bool(self.cert)

    def serves_tls(self) -> bool:
        """Whether a server given these flags serves TLS; --tls-ca without its own certificate is an error."""
        if self.ca and not self.has_identity:
            raise TlsConfigError("--tls-ca needs --tls-cert and --tls-key (the scheduler's own certificate)")
        return self.has_identity

    def identity(self) -> tuple[bytes, bytes]:
        """(private key, certificate chain) PEM, checked: certificates, an unencrypted key, the key of the first."""
        chain = read_pem(self.cert, "--tls-cert")
        key = read_pem(self.key, "--tls-key")
        check_identity(chain, key, self.cert, self.key)
        return key, chain

    def root(self) -> bytes | None:
        if not self.ca:
            return None
        data = read_pem(self.ca, "--tls-ca")
        load_certificates(data, "--tls-ca", self.ca)
        return data

    def server_pems(self, require_client_auth: bool) -> dict:
        """grpc.ssl_server_credentials' arguments: this certificate; with `require_client_auth` the peer must
        present a certificate signed by --tls-ca (mutual TLS), else none is asked for."""
        if not self.serves_tls() or (require_client_auth and not self.ca):
            raise TlsConfigError("TLS needs --tls-cert and --tls-key; mutual TLS --tls-ca too")
        return {"private_key_certificate_chain_pairs": [self.identity()], "require_client_auth": require_client_auth,
                "root_certificates": self.root() if require_client_auth else None}

    def client_pems(self) -> dict | None:
        """grpc.ssl_channel_credentials' arguments (None: plaintext, no flag given): verify the server with
        --tls-ca (else the system's roots); present --tls-cert/--tls-key when given (a worker's certificate)."""
        if not (self.ca or self.has_identity):
            return None
        key, chain = self.identity() if self.has_identity else (None, None)
        return {"root_certificates": self.root(), "private_key": key, "certificate_chain": chain}


def certificate_names(path: str) -> list[str]:
    """The DNS names and IP addresses a certificate is valid for (its subject alternative names)."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(read_pem(path, "--tls-cert"))
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [*names.get_values_for_type(x509.DNSName), *map(str, names.get_values_for_type(x509.IPAddress))]
