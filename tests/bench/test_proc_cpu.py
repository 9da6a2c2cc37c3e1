"""/proc CPU accounting of `pagedserve bench` against real processes: a listening port -> its pids, CPU seconds of
every thread, children found below the listener, ended children through their parent, names from cmdlines."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

from pagedserve_cli.bench.proc_cpu import CpuWatch, is_local, listening_pids, role, server_roots
from pagedserve_common.ports import free_port

BURN = "import sys, time\nend = time.process_time() + float(sys.argv[1])\nwhile time.process_time() < end: pass\n"
# A server stand-in: listens, and on a line from stdin burns 1.0 CPU-second in a thread (not its main one), then
# 0.3 s in a child it waits for, then starts a child that burns 0.5 s and stays; prints that child's pid.
SERVER = textwrap.dedent(f"""
    import socket, subprocess, sys, threading, time
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    print(s.getsockname()[1], flush=True)
    sys.stdin.readline()

    def burn(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    t = threading.Thread(target=burn, args=(1.0,))
    t.start()
    t.join()
    subprocess.run([sys.executable, "-c", {BURN!r}, "0.3"], check=True)
    live = subprocess.Popen([sys.executable, "-c", {BURN!r} + "print('burnt', flush=True); sys.stdin.readline()",
                             "0.5"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    live.stdout.readline()
    print(live.pid, flush=True)
    sys.stdin.readline()
    live.stdin.close()
    live.wait()
""")


def start_server() -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def test_a_listening_socket_maps_to_the_process_that_holds_it():
    proc, port = start_server()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=60):  # a client's socket is no listener
            assert listening_pids(port) == {proc.pid}
        assert is_local("127.0.0.1", port) and is_local("localhost", port)
    finally:
        proc.kill()
        proc.wait()
    with socket.socket() as mine:
        mine.bind(("127.0.0.1", 0))
        mine.listen()
        assert listening_pids(mine.getsockname()[1]) == {os.getpid()}
    nobody = free_port()
    assert listening_pids(nobody) == set() and not is_local("127.0.0.1", nobody)


def test_cpu_seconds_count_every_thread_and_child_of_the_server_and_the_client():
    proc, port = start_server()
    try:
        assert server_roots(port) == {proc.pid}
        watch = CpuWatch(port)
        watch.start()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        grandchild = int(proc.stdout.readline())  # every burn is over
        watch.sample()
        report = watch.stop()
        proc.stdin.write("end\n")
        proc.stdin.flush()
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
        proc.wait()
    rows = {r["pid"]: r for r in report["processes"]}
    assert report["local"] and set(rows) == {proc.pid, grandchild, os.getpid()}
    server, live, client = rows[proc.pid], rows[grandchild], rows[os.getpid()]
    # NOTE: lower bounds only (/proc counts in clock ticks: 0.1 s of slack for their rounding)
    assert server["cpu_s"] >= 0.9  # the burning thread's second
    assert server["reaped_children_cpu_s"] >= 0.2  # the 0.3 s child it waited for
    assert live["cpu_s"] >= 0.4 and not live["ended"]  # born during the watch: counted from 0
    assert (server["role"], live["role"], client["role"]) == ("other", "other", "client")
    assert report["by_role"]["other"] >= 0.9 + 0.2 + 0.4
    assert report["server_cpu_s"] == report["by_role"]["other"]
    assert client["cpu_s"] >= 0 and report["wall_s"] > 0


def test_a_server_that_is_not_local_measures_the_client_alone():
    watch = CpuWatch(None)
    watch.start()
    sum(i * i for i in range(200_000))
    report = watch.stop()
    assert not report["local"] and report["server_cpu_s"] is None
    assert [r["role"] for r in report["processes"]] == ["client"]


def test_roles_come_from_the_command_line():
    exe = "/venv/bin/python"
    assert role([exe, "-m", "pagedserve_cli.main", "worker", "--scheduler", "127.0.0.1:1"]) == "worker"
    assert role([exe, "/venv/bin/pagedserve", "scheduler", "--model", "m"]) == "scheduler"
    assert role(["/venv/bin/pagedserve", "--log-format", "json", "up"]) == "up"
    assert role([exe, "-m", "vllm.entrypoints.openai.api_server", "--model", "m"]) == "api server"
    assert role(["VLLM::EngineCore"]) == "engine core"
    assert role(["VLLM::Worker"]) == "worker" and role(["VLLM::APIServer_0"]) == "api server"
    assert role([exe, "-c", "from multiprocessing.resource_tracker import main;main(5)"]) == "other"
