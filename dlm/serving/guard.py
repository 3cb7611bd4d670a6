"""What every HTTP request passes before a route sees it: a request id, the API key, the body limit,
and a log line; and what no client may see: a traceback (it goes to the log with the request id)."""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from dlm.serving.protocol import ApiError

log = logging.getLogger("dlm.serving")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
RequestSink = Callable[[dict[str, Any]], None]
CLIENT_GONE = 499  # the status logged for a client that left before its answer (nginx's convention)
OPEN_PATHS = ("/health",)  # what a load balancer probes answers without the key


async def send_error(send: Send, error: ApiError, request_id: str) -> None:
    body = json.dumps(error.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", request_id.encode()),
    ]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware around the whole application (outside FastAPI's own error handling)."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int, on_request: RequestSink) -> None:
        self.app, self.api_key, self.max_body_bytes, self.on_request = app, api_key, max_body_bytes, on_request

    def _refusal(self, scope: Scope) -> ApiError | None:
        headers = dict(scope.get("headers", []))
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, key = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
                what = "no API key" if not given else "a wrong API key"
                return ApiError(
                    401, f"{what}: send the server's key as 'Authorization: Bearer KEY'", code="invalid_api_key"
                )
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return self._too_large()
        return None

    def _too_large(self) -> ApiError:
        return ApiError(
            413, f"the body is larger than this server allows ({self.max_body_bytes} bytes)", code="request_too_large"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = request_id
        status = [0]
        start = time.perf_counter()
        received = [0]

        async def limited_receive() -> Message:
            message = await receive()
            received[0] += len(message.get("body", b""))
            if received[0] > self.max_body_bytes:  # a chunked body, which named no length
                raise self._too_large()
            return message

        async def tagged_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        refusal = self._refusal(scope)
        try:
            if refusal is not None:
                status[0] = refusal.status
                await send_error(send, refusal, request_id)
            else:
                await self.app(scope, limited_receive, tagged_send)
        except Exception:  # answered as a 500 by the application's handler; the traceback stays here
            log.exception("request %s %s %s failed", request_id, scope["method"], scope["path"])
            if not status[0]:
                status[0] = 500
                await send_error(
                    send, ApiError(500, f"internal error (request {request_id})", kind="server_error"), request_id
                )
        finally:
            seconds = round(time.perf_counter() - start, 4)
            self.on_request(
                {
                    "event": "request",
                    "id": request_id,
                    "method": scope["method"],
                    "path": scope["path"],
                    "status": status[0] or CLIENT_GONE,
                    "seconds": seconds,
                }
            )
