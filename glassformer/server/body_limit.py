"""The request-body limit (issue 31, defect 3): a body larger than `serve --max-body-mb` gets a
413 in OpenAI's error shape before any of it is parsed, judged from Content-Length when the
client sends one and counted as it arrives otherwise (a chunked upload)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from glassformer.server.protocol import APIError


class BodyLimit:
    """ASGI middleware: reads a request's body, at most `max_bytes` of it, and hands it on to the
    app; past the limit it answers 413 and closes the connection without reading the rest.
    The body is read here rather than in the routes so that every route, the lab's included,
    has the same limit."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send, f"{int(declared)} bytes")
        messages, size, more = [], 0, True
        while more:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client left while sending
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send, f"over {self.max_bytes} bytes")
            more = message.get("more_body", False)

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send, size: str) -> None:
        mb = self.max_bytes / 2**20
        error = APIError(
            413,
            f"the request body is {size}; this server reads at most {self.max_bytes} bytes "
            f"({mb:g} MiB): send a smaller body, or start the server with a larger --max-body-mb",
            kind="invalid_request_error",
            code="request_too_large",
        )
        # The unread rest of the body makes the connection unusable: close it.
        response = JSONResponse(error.body(), status_code=413, headers={"Connection": "close"})
        await response(scope, receive, send)
