"""Who may attach as a worker: worker tokens (--worker-token-file), the start-up check that a reachable worker port
authenticates its workers, what the log says of an attaching peer, and `up`'s nonce (a worker of another `up`)."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass, field

from scheduler_svc.auth import ApiKeys, bearer, read_keys

TOKEN_FLAG = "--worker-token-file"
TOKEN_ID_DIGITS = 12  # the log's token_id: the first 12 hex digits of the token's SHA-256 (not a secret)
MISSING_TOKEN = "no worker token: this scheduler requires one (the worker's --worker-token-file)"
INVALID_TOKEN = "invalid worker token"  # NOTE: never echo what was sent
TWO_TOKENS = "more than one authorization entry in the call's metadata"
OTHER_UP = ("this scheduler belongs to another `pagedserve up` than this worker (their up nonces differ): a worker "
            "that `up` starts attaches only to its own up's scheduler; is another `pagedserve up` on this "
            "--worker-listen?")


class InsecureWorkersError(ValueError):
    """The worker port is reachable from other hosts and nothing authenticates the workers that dial in."""


def loopback_only(address: str) -> bool:
    """Whether HOST:PORT `address` listens on loopback alone (127.0.0.0/8, ::1 or localhost)."""
    host = address.rpartition(":")[0].strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # NOTE: '' or 0.0.0.0 (every interface), a host name, a unix: socket
        return False


def port_auth(worker_listen: str, *, mutual_tls: bool, token: bool, insecure: bool) -> str:
    """How the worker port at `worker_listen` authenticates workers, as the start-up log says it. Raises
    InsecureWorkersError when the port is not loopback-only and neither mutual TLS nor a token is configured,
    unless `insecure` (--insecure-workers)."""
    methods = [name for name, on in (("mutual TLS", mutual_tls), ("token", token)) if on]
    if methods:
        return " and ".join(methods)
    if loopback_only(worker_listen):
        return "none (loopback only)"
    if insecure:
        return "none (--insecure-workers)"
    raise InsecureWorkersError(
        f"--worker-listen {worker_listen} is not loopback-only and no worker authentication is configured: any "
        f"process that reaches it could attach as a worker, read other users' prompts and choose their replies. "
        f"Give the scheduler and its workers {TOKEN_FLAG} PATH (make one with `pagedserve worker-token PATH`), or "
        f"mutual TLS (--tls-cert, --tls-key and --tls-ca), or listen on 127.0.0.1; or pass --insecure-workers to "
        f"accept it (a network where every process is trusted)")


def token_id(token: str) -> str:
    """A short fingerprint of a token for the log: the first TOKEN_ID_DIGITS hex digits of its SHA-256."""
    return hashlib.sha256(token.encode()).hexdigest()[:TOKEN_ID_DIGITS]


@dataclass(slots=True, frozen=True)
class WorkerTokens:
    """The tokens of --worker-token-file (the --api-key-file format: one a line, # comments), as digests."""

    keys: ApiKeys

    @classmethod
    def load(cls, path: str) -> WorkerTokens:
        return cls(ApiKeys.of(read_keys(path, TOKEN_FLAG, "token", named=False)))

    def __len__(self) -> int:
        return len(self.keys)

    def check(self, authorizations: list[str | bytes]) -> tuple[str | None, str | None]:
        """(token_id, None) when the call's `authorization` values are one `Bearer TOKEN` with a valid TOKEN, else
        (None, why it is refused). NOTE: constant time over the tokens (ApiKeys.check)."""
        if len(authorizations) > 1:
            return None, TWO_TOKENS
        token = bearer(authorizations[0]) if authorizations else None
        if token is None:
            return None, MISSING_TOKEN
        return (token_id(token), None) if self.keys.check(token) else (None, INVALID_TOKEN)


def other_up(up_nonce: str | None, nonces: list[str | bytes]) -> str | None:
    """Why a worker is refused for the `up` that started it (OTHER_UP), or None. `up_nonce`: the nonce of the `up`
    that started this scheduler (None: started by hand); `nonces`: the worker's, its call's UP_NONCE_METADATA values
    (pagedserve_common.config). NOTE: a worker that presents none was started by hand and attaches as before."""
    if up_nonce is None or not nonces:
        return None
    theirs = nonces[0].encode() if isinstance(nonces[0], str) else nonces[0]
    return None if len(nonces) == 1 and hmac.compare_digest(theirs, up_nonce.encode()) else OTHER_UP


@dataclass(slots=True, frozen=True)
class WorkerGate:
    """What the worker port lets in, read once at start: a bad token file, or a reachable port that authenticates
    nobody, fails the start."""

    auth: str  # port_auth's words, for the start-up log
    tokens: WorkerTokens | None = field(default=None, repr=False)
    insecure: bool = False  # reachable, authenticating nobody: --insecure-workers said so

    @classmethod
    def load(cls, worker_listen: str, token_file: str | None, mutual_tls: bool, insecure: bool) -> WorkerGate:
        tokens = WorkerTokens.load(token_file) if token_file else None
        auth = port_auth(worker_listen, mutual_tls=mutual_tls, token=tokens is not None, insecure=insecure)
        return cls(auth, tokens, auth == "none (--insecure-workers)")
