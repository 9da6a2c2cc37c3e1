"""The HTTP front's request-size bound: a body larger than --max-message-size gets 413 before it is parsed."""

from __future__ import annotations

import json

from scheduler_svc import request_log
from scheduler_svc.http.convert import error_body


class BodyLimit:
    """ASGI middleware: refuses a body over `max_bytes`, by its Content-Length or, when chunked, as it arrives.

    NOTE: the check runs before FastAPI reads the body into memory and parses it, so an oversized request costs
    neither memory nor event-loop time (the gRPC port's max_receive_message_length does the same)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send, int(length))
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
                    await self._refuse(send, seen)
                    raise _TooLarge(seen)
            return message

        async def guarded_send(message):
            if not refused:  # whatever the app answers after the 413 is dropped
                await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except _TooLarge:
            pass

    async def _refuse(self, send, size: int) -> None:
        message = f"the request body has {size} bytes or more; the limit is {self.max_bytes} (--max-message-size)"
        request_log.refused("http", "RESOURCE_EXHAUSTED", message)
        body = json.dumps(error_body(413, message, None)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size
