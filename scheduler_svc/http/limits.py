"""The HTTP front's request-size bound: a body larger than --max-message-size gets 413 before it is parsed."""

from __future__ import annotations

import asyncio
import json

from scheduler_svc import request_log
from scheduler_svc.http.error_shapes import error_body_for


class BodyLimit:
    """ASGI middleware: refuses a body over `max_bytes`, by its Content-Length or, when chunked, as it arrives.

    NOTE: the check runs before FastAPI reads the body into memory and parses it, so an oversized request costs
    no memory (the gRPC port's max_receive_message_length does the same).

    NOTE: the unread rest of the body is read and dropped before the 413 goes out (a lingering close, as nginx
    does). Closing a socket with unread bytes makes the kernel send a reset, which can destroy the 413 in the
    client's buffer before the client reads it: it then sees "connection closed" instead of the reason. The drain
    is bounded (DRAIN_FACTOR x max_bytes, DRAIN_SECONDS); a client that announced `Expect: 100-continue` has sent
    no body yet and is answered at once."""

    DRAIN_FACTOR = 4
    DRAIN_SECONDS = 10.0

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            if b"100-continue" not in headers.get(b"expect", b"").lower():
                await self._drain(receive, 0, int(length))
            await self._refuse(send, scope["path"], int(length))
            return
        seen, refused = 0, False

        async def counted_receive():
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request" and not refused:
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # NOTE: answer now: FastAPI turns an error while it reads the body into its own 400
                    refused = True
                    if message.get("more_body", False):
                        await self._drain(receive, seen, None)
                    await self._refuse(send, scope["path"], seen)
                    raise _TooLarge(seen)
            return message

        async def guarded_send(message):
            if not refused:  # whatever the app answers after the 413 is dropped
                await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except _TooLarge:
            pass

    async def _drain(self, receive, num_read: int, num_announced: int | None) -> None:
        """Reads and drops the rest of the body, unless it is longer than the drain bound (then the client may see a
        reset instead of the 413: the price of not reading a huge body)."""
        limit = self.DRAIN_FACTOR * self.max_bytes
        if num_announced is not None and num_announced > limit:
            return
        try:
            async with asyncio.timeout(self.DRAIN_SECONDS):
                while num_read <= limit:
                    message = await receive()
                    if message["type"] != "http.request":
                        return
                    num_read += len(message.get("body", b""))
                    if not message.get("more_body", False):
                        return
        except TimeoutError:
            return

    async def _refuse(self, send, path: str, size: int) -> None:
        message = f"the request body has {size} bytes or more; the limit is {self.max_bytes} (--max-message-size)"
        request_log.refused("http", "RESOURCE_EXHAUSTED", message)
        body = json.dumps(error_body_for(path, 413, message)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size
