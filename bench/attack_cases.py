"""bench/attack.py's attackers: each runs in a process of its own (multiprocessing spawn), every socket bound to the
attacker's source address (another loopback address than the honest client's 127.0.0.1, so that a per-peer cap
tells them apart), until the main process sets the stop flag; then it puts its counts on the results queue.

Kept free of grpc and the project's modules: a spawned attacker starts fast and light."""

from __future__ import annotations

import asyncio
import collections
import json
import re
import resource

SLOWLORIS_PERIOD_S = 5.0
REOPEN_AFTER_S = 1.0
CONNECT_RETRY_S = 0.05  # after a failed connect, even for the "at once" reconnectors: no busy loop on a refusal
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + an empty SETTINGS frame
REGEX_PROMPT = "Write the letters."


async def connect(host: str, port: int, src: str, counts: collections.Counter):
    """A connection from `src`, or None (counted) when it cannot be made."""
    try:
        conn = await asyncio.open_connection(host, port, local_addr=(src, 0))
    except OSError as e:
        counts[f"connect_failed_{type(e).__name__}"] += 1
        return None
    counts["opened"] += 1
    return conn


async def opened_connections(host, port, src, stop: asyncio.Event, counts: collections.Counter, retry_s: float):
    """Each connection to host:port from `src` as it opens, until `stop` is set; one that fails to open is tried
    again `retry_s` seconds later."""
    while not stop.is_set():
        conn = await connect(host, port, src, counts)
        if conn is None:
            await asyncio.sleep(retry_s)
            continue
        yield conn


async def drain_until_closed(reader: asyncio.StreamReader, stop: asyncio.Event, counts: collections.Counter,
                             poll: float = 1.0, on_quiet=None) -> None:
    """Reads (and drops) what the server sends until it closes the connection or `stop` is set; `on_quiet()`
    after each `poll` seconds without a byte."""
    while not stop.is_set():
        try:
            data = await asyncio.wait_for(reader.read(4096), poll)
        except TimeoutError:
            if on_quiet is not None:
                on_quiet()
            continue
        except OSError:
            counts["reset_by_server"] += 1
            return
        if not data:
            counts["closed_by_server"] += 1
            return
        counts["bytes_from_server"] += len(data)


# -- connections: idle and slowloris HTTP connections held ----------------------------------------------------------
async def hold_http(host, port, src, slow: bool, stop, counts) -> None:
    """One HTTP connection held open (idle, or a header byte every SLOWLORIS_PERIOD_S), opened again a second after
    the server closes it."""
    async for reader, writer in opened_connections(host, port, src, stop, counts, REOPEN_AFTER_S):
        if slow:
            writer.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n")
        try:
            while not stop.is_set():
                try:
                    first = await asyncio.wait_for(reader.read(64), SLOWLORIS_PERIOD_S if slow else 1.0)
                except TimeoutError:
                    if slow:
                        writer.write(b"x")  # one more header byte
                    continue
                counts["closed_by_server" if not first else f"answered_{first[9:12].decode(errors='replace')}"] += 1
                break
        except OSError:
            counts["reset_by_server"] += 1
        finally:
            writer.close()
        await asyncio.sleep(REOPEN_AFTER_S)


def connections(p: dict, stop, counts) -> list:
    return [hold_http(p["host"], p["port"], p["src"], i >= p["idle"], stop, counts)
            for i in range(p["idle"] + p["slowloris"])]


# -- regex_*: structured output requests, each re-sent as soon as it is answered -----------------------------------
async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response: status, headers (lower-cased names) and body (content-length, chunked, or to EOF)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        await reader.readuntil(b"\r\n")  # the (empty) trailers' end
        body = b"".join(parts)
    else:
        body = await reader.read()
    return status, headers, body


def note_answer(status: int, body: bytes, prefix: re.Pattern, counts: collections.Counter) -> None:
    """Counts the status; of a 200, its finish reason and whether its text is a prefix of a match (`prefix`)."""
    counts[f"status_{status}"] += 1
    if status != 200:
        return
    try:
        choice = json.loads(body)["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        counts["unreadable_200"] += 1
        return
    reason, text = choice.get("finish_reason"), choice.get("text") or ""
    counts[f"finish_{reason}"] += 1
    if not prefix.fullmatch(text):
        counts["bad_text"] += 1
    if reason == "stop" and not prefix.fullmatch(text):
        counts["bad_stop"] += 1


async def flood_regex(host, port, src, body: bytes, prefix: re.Pattern, stop, counts) -> None:
    """Sends the request on a keep-alive connection, again as soon as it is answered (a new connection when the
    server closes one)."""
    request = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
               f"content-length: {len(body)}\r\n\r\n").encode() + body
    async for reader, writer in opened_connections(host, port, src, stop, counts, CONNECT_RETRY_S):
        try:
            while not stop.is_set():
                writer.write(request)
                status, headers, answer = await read_response(reader)
                note_answer(status, answer, prefix, counts)
                if headers.get("connection", "").lower() == "close":
                    break
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError):
            counts["connection_lost"] += 1
        finally:
            writer.close()


def regex_flood(p: dict, stop, counts) -> list:
    body = json.dumps({"model": p["model"], "prompt": REGEX_PROMPT, "max_tokens": p["max_tokens"], "temperature": 0,
                       "structured_outputs": {"regex": p["regex"]}}).encode()
    prefix = re.compile(p["prefix"])
    return [flood_regex(p["host"], p["port"], p["src"], body, prefix, stop, counts) for _ in range(p["flood"])]


# -- grpc_idle, grpc_reconnect, http_reconnect: connections that say a little, then nothing -----------------------
async def hold(host, port, src, first: bytes, reopen_after: float, stop, counts) -> None:
    """One connection that sends `first` (gRPC: the HTTP/2 preface and an empty SETTINGS frame; HTTP: a partial
    head), then stays idle until the server closes it; opened again `reopen_after` seconds later."""
    while not stop.is_set():
        conn = await connect(host, port, src, counts)
        if conn is None:
            await asyncio.sleep(max(reopen_after, CONNECT_RETRY_S))
            continue
        reader, writer = conn
        try:
            writer.write(first)
            await drain_until_closed(reader, stop, counts)
        finally:
            writer.close()
        if reopen_after:
            await asyncio.sleep(reopen_after)


def grpc_idle(p: dict, stop, counts) -> list:
    return [hold(p["host"], p["port"], p["src"], H2_PREFACE, REOPEN_AFTER_S, stop, counts)
            for _ in range(p["connections"])]


def grpc_reconnect(p: dict, stop, counts) -> list:
    return [hold(p["host"], p["port"], p["src"], H2_PREFACE, 0.0, stop, counts) for _ in range(p["connections"])]


def http_reconnect(p: dict, stop, counts) -> list:
    # NOTE: a partial head: the server waits for the rest (--header-timeout), or refuses it over a cap
    return [hold(p["host"], p["port"], p["src"], b"GET /v1/models HTTP/1.1\r\n", 0.0, stop, counts)
            for _ in range(p["connections"])]


ATTACKS = {"connections": connections, "regex": regex_flood, "grpc_idle": grpc_idle,
           "grpc_reconnect": grpc_reconnect, "http_reconnect": http_reconnect}


async def attack(kind: str, params: dict, stop_flag, ready_flag, results) -> None:
    stop, counts = asyncio.Event(), collections.Counter()
    tasks = [asyncio.create_task(c) for c in ATTACKS[kind](params, stop, counts)]
    ready_flag.set()
    while not stop_flag.is_set():
        await asyncio.sleep(0.2)
    stop.set()
    await asyncio.wait(tasks, timeout=5)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    results.put(dict(counts))


def attacker_main(kind: str, params: dict, stop_flag, ready_flag, results) -> None:
    """The attacker process: its soft open files limit raised to the hard one, then the attack until stop_flag."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    asyncio.run(attack(kind, params, stop_flag, ready_flag, results))
