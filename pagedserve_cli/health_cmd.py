"""`pagedserve health`: exit 0 only when the scheduler's gRPC health service says SERVING (container health checks)."""

from __future__ import annotations

import argparse
import sys

from pagedserve_cli import access_args
from pagedserve_common.defaults import DEFAULT_LISTEN


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("health", help="exit 0 when the server is SERVING (a worker attached, not draining), else 1")
    p.add_argument("--server", default=DEFAULT_LISTEN, help="the client API, HOST:PORT")
    p.add_argument("--service", default="", help="the health service name to ask about (default '': the server)")
    p.add_argument("--worker", metavar="HOST",
                   help="also require an attached worker registered from HOST (its name is HOST:PID), e.g. "
                        "$(hostname) in a worker container's health check")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds for each call (default 5)")
    access_args.add_client_args(p)  # NOTE: health needs no key; --worker asks GetModelInfo, which does
    p.set_defaults(func=run)


def worker_attached(workers, host: str) -> bool:
    """Whether one of GetModelInfo's workers registered from `host` (names are HOST:PID)."""
    return any(w.name == host or w.name.rpartition(":")[0] == host for w in workers)


def run(args: argparse.Namespace) -> int:
    # NOTE: only grpc and the generated stubs: a health check runs every few seconds, so it must start fast.
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pagedserve.v1 import generate_pb2, generate_pb2_grpc

    with access_args.client_channel(args, args.server) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                print(f"{args.server}: {status}", file=sys.stderr)
                return 1
            if args.worker:
                info = generate_pb2_grpc.GenerationStub(channel).GetModelInfo(
                    generate_pb2.GetModelInfoRequest(), timeout=args.timeout,
                    metadata=access_args.client_metadata(args))
                if not worker_attached(info.workers, args.worker):
                    names = ", ".join(w.name for w in info.workers) or "none"
                    print(f"{args.server}: SERVING, but no worker from {args.worker} is attached (attached: {names})",
                          file=sys.stderr)
                    return 1
        except grpc.RpcError as e:
            print(f"{args.server}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(f"{args.server}: {status}")
    return 0
