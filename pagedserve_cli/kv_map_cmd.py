"""`pagedserve kv-map`: a live terminal map of one worker's KV blocks, redrawn from GetKVState every --interval."""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time

from pagedserve_cli import access_args
from pagedserve_common.defaults import DEFAULT_LISTEN
from pagedserve_common.grpc_options import receive_limit

LABEL_WIDTH = 8  # the block id before each grid row, and a margin
MAX_MESSAGE_BYTES = 256 << 20  # NOTE: a million blocks is ~2 MB of bytes plus the block tables; gRPC's default is 4 MB
HIDE_CURSOR, SHOW_CURSOR, HOME, CLEAR_SCREEN, CLEAR_BELOW, CLEAR_LINE = (
    "\x1b[?25l", "\x1b[?25h", "\x1b[H", "\x1b[2J", "\x1b[J", "\x1b[K")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kv-map", help="live map of a worker's KV blocks: who holds which block, sharing, "
                                      "fragmentation, prefix-cache hits")
    p.add_argument("--server", default=DEFAULT_LISTEN, help="the client API, HOST:PORT")
    p.add_argument("--worker", default="", metavar="ID",
                   help="a worker id as GetModelInfo lists it (default: the first attached)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between frames (default 1)")
    p.add_argument("--once", action="store_true",
                   help="print one frame and exit (colours only when stdout is a terminal)")
    p.add_argument("--width", type=int, metavar="N", help="cells per grid row (default: the terminal's width)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds for each call (default 10)")
    access_args.add_client_args(p)
    p.set_defaults(func=run)


def grid_width(requested: int | None) -> int:
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--width must be >= 1, got {requested}")
        return requested
    return max(8, shutil.get_terminal_size((80, 24)).columns - LABEL_WIDTH)


def fetch(stub, args: argparse.Namespace, metadata):
    from pagedserve.v1 import generate_pb2

    from pagedserve_cli.kv_state import KVSnapshot

    return KVSnapshot.from_pb(stub.GetKVState(generate_pb2.GetKVStateRequest(worker_id=args.worker),
                                              timeout=args.timeout, metadata=metadata))


def _paint_frame(out, text: str, tty: bool) -> None:
    if tty:  # NOTE: home, then each line over the last frame's (no blank flash), then clear what is left
        out.write(HOME + text.replace("\n", CLEAR_LINE + "\n") + CLEAR_BELOW)
    else:
        out.write(text + "\n")
    out.flush()


def run(args: argparse.Namespace) -> int:
    import grpc

    from pagedserve.v1 import generate_pb2_grpc
    from pagedserve_cli.kv_render import render

    if args.interval <= 0:
        raise ValueError(f"--interval must be > 0 seconds, got {args.interval}")
    out = sys.stdout
    tty = out.isatty()
    metadata = access_args.client_metadata(args)
    options = receive_limit(MAX_MESSAGE_BYTES)
    with access_args.client_channel(args, args.server, options) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        if args.once:
            try:
                snap = fetch(stub, args, metadata)
            except grpc.RpcError as e:
                print(f"pagedserve kv-map: {e.code().name}: {e.details()}", file=sys.stderr)
                return 1
            out.write(render(snap, grid_width(args.width), colour=tty, source=args.server))
            return 0
        _stop_on_signals()
        if tty:
            out.write(HIDE_CURSOR + CLEAR_SCREEN)
        try:
            return _live(stub, args, metadata, out, tty)
        except KeyboardInterrupt:
            return 0
        finally:
            if tty:
                out.write(SHOW_CURSOR + "\n")
                out.flush()


def _stop_on_signals() -> None:
    """Ctrl-C (SIGINT), SIGTERM and a closed terminal (SIGHUP) end the live view through its `finally`, which
    shows the cursor again.

    NOTE: installed whatever the disposition inherited. A shell without job control starts a background job
    with SIGINT ignored so that the terminal's Ctrl-C spares it, and Python keeps an ignored SIGINT ignored; but
    the live view is a foreground program whose only way out is Ctrl-C, so honouring that would leave it
    unstoppable but by SIGKILL, with the cursor hidden. (A job that job control put in the background gets no
    Ctrl-C from the terminal anyway: it is not in the foreground process group.)"""
    def stop(signum: int, frame) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def _live(stub, args: argparse.Namespace, metadata, out, tty: bool) -> int:
    """Redraws until Ctrl-C. UNAVAILABLE (no worker yet, a restart) is shown and retried; other errors end it."""
    import grpc

    from pagedserve_cli.kv_render import render

    while True:
        started = time.monotonic()
        try:
            text = render(fetch(stub, args, metadata), grid_width(args.width), colour=tty, source=args.server)
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                print(f"pagedserve kv-map: {e.code().name}: {e.details()}", file=sys.stderr)
                return 1
            text = f"pagedserve kv-map  {args.server}: {e.code().name}: {e.details()} (retrying)\n"
        _paint_frame(out, text, tty)
        time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
