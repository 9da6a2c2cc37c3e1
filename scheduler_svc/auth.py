"""API keys on the client API: the key file (named keys), a constant-time check, a gRPC interceptor, ASGI middleware."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pagedserve_common.startup import StartupError, check_bindable
from pagedserve_common.tls import TlsFiles
from scheduler_svc import request_log
from scheduler_svc.identity import Identity, parse_identity

PROTECTED_GRPC = ("/pagedserve.v1.Generation/",)  # NOTE: health and reflection stay open
# NOTE: liveness and the version stay open (probes, load balancers); every other route needs a key, /metrics and
# /tokenize included (they show the server's load and spend its tokenizer)
OPEN_HTTP = ("/health", "/ping", "/version")
MISSING = "no API key: send the header `authorization: Bearer KEY`"
DUPLICATE = "more than one authorization header: send exactly one, `authorization: Bearer KEY` (or, over HTTP, " \
            "`x-api-key: KEY`)"
INVALID = "invalid API key"  # NOTE: never echo what was sent


@dataclass(slots=True)
class Access:
    """The scheduler's access flags, read once at start (a bad file fails the start, naming its flag)."""

    clients: grpc.ServerCredentials | None = None  # the client API: TLS, no client certificate asked
    workers: grpc.ServerCredentials | None = None  # the worker port: TLS, mutual with --tls-ca
    http_ssl: tuple[str, str] | None = None  # the HTTP front: (certificate file, key file)
    api_keys: ApiKeys | None = None
    mutual: bool = False

    @classmethod
    def load(cls, tls_cert: str | None, tls_key: str | None, tls_ca: str | None,
             api_key_file: str | None) -> Access:
        files = TlsFiles(tls_cert, tls_key, tls_ca)
        keys = load_keys(api_key_file) if api_key_file else None
        if not files.serves_tls():
            return cls(api_keys=keys)
        return cls(grpc.ssl_server_credentials(**files.server_pems(require_client_auth=False)),
                   grpc.ssl_server_credentials(**files.server_pems(require_client_auth=bool(tls_ca))),
                   (tls_cert, tls_key), keys, bool(tls_ca))

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [ApiKeyInterceptor(self.api_keys)] if self.api_keys else []


def add_port(server: grpc.aio.Server, flag: str, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Listens on `address` (given by `flag`); the port bound. A port that cannot be bound is a StartupError naming
    both."""
    check_bindable(flag, address)
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError as e:  # NOTE: taken in the moment since check_bindable, or refused by gRPC itself
        raise StartupError(f"{flag} {address}: cannot listen there ({e})") from None


class ApiKeyFileError(ValueError):
    """The --api-key-file cannot be read or holds no key (the message never quotes a key)."""


def load_keys(path: str) -> ApiKeys:
    return ApiKeys.of(*zip(*read_key_identities(path)))


def read_keys(path: str, flag: str = "--api-key-file", what: str = "key", named: bool = True) -> list[str]:
    """The keys in `path`, their names and attributes dropped (read_key_identities); `named` False: lines of one
    word each, `what`s (--worker-token-file's tokens)."""
    if named:
        return [key for key, _ in read_key_identities(path, flag)]
    return [key for _, key, _ in _key_lines(path, flag, what, False)]


def read_named_keys(path: str, flag: str = "--api-key-file") -> list[tuple[str, str]]:
    """(key, name) of each line of `path` (name "" when absent): read_key_identities' tenants."""
    return [(key, identity.tenant) for key, identity in read_key_identities(path, flag)]


def read_key_identities(path: str, flag: str = "--api-key-file") -> list[tuple[str, Identity]]:
    """(key, what it grants) of each `KEY [NAME] [max-priority=N] [role=R]` line of `path` (identity.KEY_LINE);
    blank lines and lines starting with # are ignored. NOTE: a key's name is the tenant its requests count for
    (their service under the fair policy, their prefix cache, their request ids); several keys may share one."""
    out = []
    for number, key, rest in _key_lines(path, flag, "key", True):
        try:
            out.append((key, parse_identity(rest)))
        except ValueError as e:
            raise ApiKeyFileError(f"{flag} {path}: line {number}: {e}") from None
    return out


def _key_lines(path: str, flag: str, what: str, named: bool) -> list[tuple[int, str, str]]:
    """(line number, key, the rest of the line) of each line of `path` holding a key (`named` False: nothing may
    follow it: the worker tokens of --worker-token-file share the format, without names). `flag` and `what` name
    the file's flag and its secrets in errors, which never quote a key."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ApiKeyFileError(f"{flag} {path}: cannot read it: {getattr(e, 'strerror', None) or e}") from None
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, rest = line.partition(" ") if named else (line, "", "")
        if any(c.isspace() for c in key) or not key.isprintable() or not key.isascii():
            shape = "KEY [NAME]: the key" if named else f"a {what}"
            raise ApiKeyFileError(f"{flag} {path}: line {number}: {shape} is printable ASCII without spaces")
        lines.append((number, key, rest.strip()))
    if not lines:
        raise ApiKeyFileError(f"{flag} {path}: no {what} in it (one {what} a line; blank lines and # comments "
                              f"are ignored)")
    return lines


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


@dataclass(slots=True, frozen=True)
class ApiKeys:
    """The accepted keys, kept as SHA-256 digests (so comparing takes the same time whatever a key's length), and
    what each grants (an Identity: its name, the tenant its requests count for, its role, its priority cap)."""

    digests: tuple[bytes, ...] = field(repr=False)
    identities: tuple[Identity, ...] = ()  # NOTE: one per digest

    @classmethod
    def of(cls, keys, grants=()) -> ApiKeys:
        """`grants`: one per key, an Identity or a name (a tenant key of that name); none: unnamed tenant keys."""
        keys = tuple(keys)
        identities = tuple(g if isinstance(g, Identity) else Identity(g) for g in grants) or (Identity(),) * len(keys)
        if len(identities) != len(keys):
            raise ValueError(f"{len(keys)} keys and {len(identities)} grants: one each")
        return cls(tuple(_digest(k.encode()) for k in keys), identities)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(i.tenant for i in self.identities)

    def __len__(self) -> int:
        return len(self.digests)

    def _match(self, key: str | bytes) -> int:
        """The index of `key` among the keys, -1 if none. NOTE: compares against every key, in constant time,
        without stopping at a match: the time taken says nothing about which key matched or how much of one."""
        presented = _digest(key.encode() if isinstance(key, str) else key)
        found = -1
        for i, digest in enumerate(self.digests):
            equal = hmac.compare_digest(digest, presented)
            found = (found, i)[equal]
        return found

    def check(self, key: str | bytes) -> bool:
        """Whether `key` is one of the keys."""
        return self._match(key) >= 0

    def identity_of(self, authorizations) -> Identity:
        """What the key of a request's `authorization` values grants (one value, already let in by the
        interceptor); with none valid, the least: an unnamed tenant key's."""
        key = bearer(authorizations[0]) if len(authorizations) == 1 else None
        return self._identity(key)

    def name_of(self, authorizations) -> str:
        """The name of the key of a request's `authorization` values: "" for an unnamed key (or none valid)."""
        return self.identity_of(authorizations).tenant

    def _identity(self, key: str | None) -> Identity:
        at = self._match(key) if key is not None else -1
        return self.identities[at] if at >= 0 else Identity()

    def http_key(self, headers) -> tuple[str | None, str | None]:
        """(key, refusal) of an HTTP request's `headers` ((name, value) pairs, names lower-case, str or bytes): the
        key of its one `authorization: Bearer KEY` or `x-api-key: KEY` (Anthropic's header), or why it has none.
        NOTE: two credentials are refused, not one picked: a proxy and the server could each read a different one."""
        found = [(k if isinstance(k, str) else k.decode("latin-1"), v if isinstance(v, str) else v.decode("latin-1"))
                 for k, v in headers if k in (b"authorization", "authorization", b"x-api-key", "x-api-key")]
        if len(found) > 1:
            return None, DUPLICATE
        if not found:
            return None, MISSING
        name, value = found[0]
        key = bearer(value) if name == "authorization" else value.strip() or None
        if key is None:
            return None, MISSING
        return (key, None) if self.check(key) else (None, INVALID)

    def identity_of_http(self, headers) -> Identity:
        """identity_of() of the key an HTTP request presents (already let in by the middleware)."""
        return self._identity(self.http_key(headers)[0])

    def refusal_of(self, headers, name: str | bytes) -> str | None:
        """refusal() of the `name` header among `headers` ((name, value) pairs: gRPC metadata, ASGI headers).
        NOTE: two are refused rather than one picked: a proxy and the server could each read a different one."""
        values = [v for k, v in headers if k == name]
        if len(values) > 1:
            return DUPLICATE
        return self.refusal(values[0] if values else None)

    def refusal(self, authorization: str | bytes | None) -> str | None:
        """None when the `authorization` value is `Bearer KEY` with a valid KEY, else why it is refused."""
        key = bearer(authorization)
        if key is None:
            return MISSING
        return None if self.check(key) else INVALID


def bearer(authorization: str | bytes | None) -> str | None:
    """KEY of an `authorization` value `Bearer KEY` (None when it is not one)."""
    if isinstance(authorization, bytes):
        authorization = authorization.decode("latin-1")
    scheme, _, key = (authorization or "").strip().partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every method of the protected services with UNAUTHENTICATED unless the call's metadata has
    `authorization: Bearer KEY` with a valid key; other services (health, reflection) pass untouched."""

    def __init__(self, keys: ApiKeys, protected: tuple[str, ...] = PROTECTED_GRPC) -> None:
        self.keys = keys
        self.protected = protected

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if not details.method.startswith(self.protected):
            return handler
        why = self.keys.refusal_of(details.invocation_metadata or (), "authorization")
        if why is None:
            return handler
        return _denying(handler, why)


def _denying(handler, why: str):
    """A handler of the same kind as `handler` (the client expects its framing) that only refuses. NOTE: it reads
    the request with `handler`'s deserializer, so that the log line carries the client's request_id."""
    async def deny(request, context) -> None:
        rid = getattr(request, "request_id", "")
        request_log.refused("grpc", "UNAUTHENTICATED", why, request_id=rid if isinstance(rid, str) else "")
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    if handler is not None and handler.response_streaming:
        make = grpc.stream_stream_rpc_method_handler if handler.request_streaming \
            else grpc.unary_stream_rpc_method_handler
    else:
        make = grpc.stream_unary_rpc_method_handler if handler is not None and handler.request_streaming \
            else grpc.unary_unary_rpc_method_handler
    return make(deny, request_deserializer=getattr(handler, "request_deserializer", None))


class ApiKeyMiddleware:
    """ASGI: refuses requests to any path but `open_paths` without one valid key (`authorization: Bearer KEY` or
    `x-api-key: KEY`) with a 401 whose body is `error_body(message, path)` (the path picks the API's error shape:
    OpenAI's or Anthropic's). Plain ASGI, not BaseHTTPMiddleware, so that streams pass through untouched."""

    def __init__(self, app, keys: ApiKeys, error_body: Callable[[str, str], dict],
                 open_paths: tuple = OPEN_HTTP) -> None:
        self.app = app
        self.keys = keys
        self.error_body = error_body
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            _, why = self.keys.http_key(scope["headers"])  # NOTE: ASGI: lower-case bytes
            if why is not None:
                request_log.refused("http", "UNAUTHENTICATED", why)
                body = json.dumps(self.error_body(why, scope["path"])).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
