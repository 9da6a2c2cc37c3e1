"""Start-up failures as one line naming the flag or path: the error type `pagedserve`'s commands print, and ports."""

from __future__ import annotations

import errno
import ipaddress
import socket

USAGE, RUNTIME = 2, 1  # exit codes: a flag's value is wrong / the environment refuses it (a port taken)

# NOTE: what a bind's errno means to someone choosing an address
BIND_ERRORS = {errno.EADDRINUSE: "address already in use",
               errno.EACCES: "permission denied (ports below 1024 need privileges)",
               errno.EADDRNOTAVAIL: "no such address on this host"}


class StartupError(Exception):
    """A service cannot start. Its message names the flag or path and what to do instead; `pagedserve` prints it as
    one line, `pagedserve COMMAND: error: MESSAGE`, and exits with `exit_code` (no traceback)."""

    def __init__(self, message: str, exit_code: int = RUNTIME) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def one_line(e: BaseException) -> str:
    """The first line of an exception's message (a library's may run on for a page)."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def host_port(flag: str, address: str) -> tuple[str, int]:
    """(host, port) of HOST:PORT `address` (brackets off an IPv6 host: '[::1]:80' is ('::1', 80))."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise StartupError(f"{flag} {address}: expected HOST:PORT (a port 0-65535)", USAGE)
    return host.strip("[]"), int(port)


def bind_failure(flag: str, address: str, e: OSError, off: bool = False) -> StartupError:
    """The one line for a listening socket at `address` (given by `flag`) that could not be bound; `off`: the flag
    takes '' for none."""
    what = BIND_ERRORS.get(e.errno, e.strerror or str(e))
    instead = f"pass another {flag} HOST:PORT" + (", or '' for none" if off else "")
    return StartupError(f"{flag} {address}: {what} ({instead})")


def check_bindable(flag: str, address: str) -> None:
    """Raises StartupError when a server could not listen on HOST:PORT `address`: a port taken, a host that is not
    this one. NOTE: for gRPC, which says only "Failed to bind" (and prints a C++ log line first): the same bind
    here, closed at once, tells why. With SO_REUSEADDR, as gRPC binds (a port in TIME_WAIT is free)."""
    if address.startswith(("unix:", "unix-abstract:", "vsock:")):
        return
    host, port = host_port(flag, address)
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StartupError(f"{flag} {address}: cannot resolve {host!r}: {e.strerror}", USAGE) from None
    errors = []
    for family, kind, proto, _, where in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and ipaddress.ip_address(where[0].split("%")[0]).is_unspecified:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # NOTE: '[::]' is dual-stack in gRPC
            try:
                s.bind(where)
            except OSError as e:
                errors.append(e)
    # NOTE: one address of several taken (localhost's 127.0.0.1 of 127.0.0.1 and ::1) fails too: gRPC would listen
    # on the other alone, and clients of the taken one would reach whoever holds it
    taken = [e for e in errors if e.errno in (errno.EADDRINUSE, errno.EACCES)]
    if taken or (errors and len(errors) == len(infos)):
        raise bind_failure(flag, address, (taken or errors)[0])
