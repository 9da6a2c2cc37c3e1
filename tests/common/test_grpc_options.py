"""The gRPC settings both ends of the worker link use (pagedserve_common.grpc_options)."""

from pagedserve_common import grpc_options
from pagedserve_common.grpc_options import WORKER_CHANNEL_OPTIONS, WORKER_SERVER_OPTIONS


def test_the_worker_port_and_the_workers_channel_agree_on_keepalive_and_message_sizes():
    server, channel = dict(WORKER_SERVER_OPTIONS), dict(WORKER_CHANNEL_OPTIONS)
    for key in ("grpc.keepalive_time_ms", "grpc.keepalive_timeout_ms", "grpc.keepalive_permit_without_calls",
                "grpc.max_receive_message_length", "grpc.max_send_message_length"):
        assert server[key] == channel[key], key
    assert (server["grpc.keepalive_time_ms"], server["grpc.keepalive_timeout_ms"]) == (10_000, 5_000)
    assert server["grpc.max_receive_message_length"] == 64 << 20
    # NOTE: the server takes the client's pings (10 s apart, with no call) without a strike, and shares no port
    assert server["grpc.http2.min_ping_interval_without_data_ms"] <= channel["grpc.keepalive_time_ms"]
    assert (server["grpc.http2.max_ping_strikes"], server["grpc.so_reuseport"]) == (0, 0)
    assert channel["grpc.http2.max_pings_without_data"] == 0
    assert "grpc.so_reuseport" not in channel


def test_a_receive_limit_is_one_option():
    assert grpc_options.receive_limit(123) == (("grpc.max_receive_message_length", 123),)
    assert dict(grpc_options.message_limits(9)) == {"grpc.max_receive_message_length": 9,
                                                     "grpc.max_send_message_length": 9}
