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
        """(private key, certificate chain) PEM."""
        chain = read_pem(self.cert, "--tls-cert")
        return read_pem(self.key, "--tls-key"), chain

    def root(self) -> bytes | None:
        return read_pem(self.ca, "--tls-ca") if self.ca else None

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
