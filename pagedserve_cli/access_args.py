"""The access flags of the client subcommands (the services' come from pagedserve_common.config), and the channels
and metadata that access flags make (TLS, mutual TLS, API keys)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pagedserve_common.config import TLS_SERVER_NAME_HELP


def add_client_args(p: argparse.ArgumentParser) -> None:
    """`generate`, `health`, `bench`: clients of the gRPC API."""
    p.add_argument("--tls-ca", metavar="PEM", help="use TLS, verifying the server's certificate with this CA")
    p.add_argument("--tls-server-name", metavar="NAME", help=TLS_SERVER_NAME_HELP)
    p.add_argument("--api-key", metavar="KEY", help="sent as `authorization: Bearer KEY`")
    p.add_argument("--api-key-file", metavar="PATH", help="send the first key of this file (the scheduler's "
                                                         "format), unless --api-key is given")


def channel_credentials(files):
    """gRPC credentials for a client given these TlsFiles (None: plaintext); reads the files now."""
    import grpc

    pems = files.client_pems()
    return grpc.ssl_channel_credentials(**pems) if pems else None


def name_override(server_name: str | None) -> list[tuple[str, str]]:
    """Channel options that check the server's certificate for `server_name` instead of the host dialled."""
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []


def open_channel(address: str, credentials, server_name: str | None = None, options=()):
    """A channel to `address`: TLS with `credentials`, plaintext without."""
    import grpc

    if credentials is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, credentials, options=[*options, *name_override(server_name)])


def worker_credentials(args: argparse.Namespace):
    """The worker's channel credentials (None: plaintext); reads its files now, so a bad one fails the start."""
    from pagedserve_common.tls import TlsFiles

    return channel_credentials(TlsFiles(args.tls_cert, args.tls_key, args.tls_ca))


def client_channel(args: argparse.Namespace, address: str, options=()):
    """A channel to `address` as the client flags say: TLS with --tls-ca, else plaintext."""
    from pagedserve_common.tls import TlsFiles

    return open_channel(address, channel_credentials(TlsFiles(ca=args.tls_ca)), args.tls_server_name, options)


def api_key_metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying the API key (none without one)."""
    return (("authorization", f"Bearer {key}"),) if key else ()


def client_metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The call metadata of a client's --api-key, else of the first key in its --api-key-file."""
    return api_key_metadata(args.api_key or first_key(args.api_key_file))


def first_key(path: str | None) -> str | None:
    from scheduler_svc.auth import read_keys

    return read_keys(path)[0] if path else None


def worker_token_metadata(path: str | None) -> tuple[tuple[str, str], ...]:
    """The Attach call's metadata of a worker's --worker-token-file: its first token (none without a file)."""
    from scheduler_svc.auth import read_keys
    from scheduler_svc.worker_auth import TOKEN_FLAG

    return api_key_metadata(read_keys(path, TOKEN_FLAG, "token", named=False)[0] if path else None)


def up_server_name(cert: str, address: str) -> str | None:
    """The name `up` checks in its scheduler's certificate when it dials `address` (its own scheduler, whatever
    names the certificate was issued for): None when the certificate names the host dialled, else its first name."""
    from pagedserve_common.tls import certificate_names

    names = certificate_names(cert)
    host = address.rpartition(":")[0].strip("[]")
    return None if not names or host in names else names[0]


@dataclass(slots=True)
class UpTls:
    """What `up`'s access flags mean for its workers and its own health wait: one trust domain, so the workers
    present the scheduler's certificate (valid for client auth, as `pagedserve certs` makes it) and verify the
    scheduler with --tls-ca, and `up` checks health with the first key of --api-key-file."""

    worker_argv: list[str]
    credentials: object = None  # grpc.ChannelCredentials for the health wait (None: plaintext)
    server_name: str | None = None
    metadata: tuple = ()


def up_tls(args: argparse.Namespace) -> UpTls:
    """Also checks `up`'s worker port as its scheduler will (scheduler_svc.worker_auth), before anything starts."""
    from pagedserve_common.tls import TlsFiles
    from scheduler_svc.worker_auth import WorkerGate

    metadata = api_key_metadata(first_key(args.api_key_file))
    WorkerGate.load(args.worker_listen, args.worker_token_file, bool(args.tls_cert and args.tls_ca),
                    args.insecure_workers)
    files = TlsFiles(args.tls_cert, args.tls_key, args.tls_ca)
    if not files.serves_tls():
        return UpTls([], metadata=metadata)
    if not args.tls_ca:
        raise ValueError("up with --tls-cert needs --tls-ca: the CA that signed it, which its workers verify the "
                         "scheduler with and present the same certificate to (mutual TLS)")
    worker_argv = ["--tls-ca", args.tls_ca, "--tls-cert", args.tls_cert, "--tls-key", args.tls_key]
    if name := up_server_name(args.tls_cert, args.worker_listen):
        worker_argv += ["--tls-server-name", name]
    return UpTls(worker_argv, channel_credentials(TlsFiles(ca=args.tls_ca)),
                 up_server_name(args.tls_cert, args.listen), metadata)
