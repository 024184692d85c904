"""What stands between a request and the routes: the API key, the response counts, and the
error handlers that turn every failure into OpenAI's error body (a 4xx for bad input, a 500 that
keeps the server running)."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Mapping
from pathlib import Path

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from glassformer.server.metrics import Metrics
from glassformer.server.protocol import APIError

log = logging.getLogger("glassformer.server")


async def api_error(request: Request, err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {err.detail}"
    return await api_error(request, APIError(err.status_code, message, kind=kind))


async def server_error(request: Request, err: Exception) -> JSONResponse:
    log.exception("unexpected error on %s", request.url.path)
    message = f"the server failed on this request ({type(err).__name__}); it keeps running"
    return await api_error(request, APIError(500, message, kind="server_error"))


IGNORED_FIELDS_HEADER = "x-glassformer-ignored-fields"

# the page itself (/, /lab/static) stays open
PROTECTED = ("/v1/", "/metrics", "/lab/api/", "/tokenize", "/detokenize")
ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/models",
    "/health",
    "/metrics",
    "/tokenize",
    "/detokenize",
)
MODEL_ENDPOINT = "/v1/models/{id}"  # one series for every id, not one per name asked for


class Gate:
    """ASGI middleware: the API key (a 401 without `Authorization: Bearer KEY`, compared in
    constant time) on /v1/*, /metrics and the lab's /lab/api/*, and a count of every response
    by endpoint and status. A reply to a request with fields that cannot take effect here
    (request.state.ignored_fields, set by the route) names them in IGNORED_FIELDS_HEADER.
    Plain ASGI rather than BaseHTTPMiddleware, so streams and disconnects pass straight
    through."""

    def __init__(self, app, api_key: str | None, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        if path.startswith("/v1/models/"):
            endpoint = MODEL_ENDPOINT
        status = 500

        async def counted_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = _with_ignored_fields(scope, message)
            await send(message)

        try:
            if self.api_key and path.startswith(PROTECTED) and not self._authorized(scope):
                response = JSONResponse(
                    APIError(
                        401,
                        "missing or wrong API key: send the header 'Authorization: Bearer KEY' "
                        "with the key the server was started with (--api-key, "
                        f"--api-key-file or {API_KEY_ENV})",
                        code="invalid_api_key",
                    ).body(),
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
                return await response(scope, receive, counted_send)
            await self.app(scope, receive, counted_send)
        finally:
            self.metrics.count_request(endpoint, status)

    def _authorized(self, scope) -> bool:
        headers = dict(scope["headers"])
        value = headers.get(b"authorization", b"")
        scheme, _, token = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)


def _with_ignored_fields(scope, message: dict) -> dict:
    fields = scope.get("state", {}).get("ignored_fields")
    if not fields:
        return message
    value = ", ".join(fields)
    log.info("%s: ignored fields that cannot change the output here: %s", scope["path"], value)
    headers = [*message.get("headers", []), (IGNORED_FIELDS_HEADER.encode(), value.encode())]
    return {**message, "headers": headers}


# --- the key ------------------------------------------------------------------------------------

API_KEY_ENV = "GLASSFORMER_API_KEY"


def resolve_api_key(
    flag: str | None, key_file: str | None, environ: Mapping[str, str]
) -> str | None:
    """The API key from --api-key, --api-key-file (its first line) or $GLASSFORMER_API_KEY, in
    that order of preference; None serves without one. The last two keep the key out of `ps`."""
    if flag is not None and key_file is not None:
        raise ValueError("--api-key and --api-key-file both set: give one of them")
    if flag is not None:
        if not flag.strip():
            raise ValueError(
                "--api-key is empty: give a key, or drop the flag to serve without one"
            )
        return flag
    if key_file is not None:
        try:
            text = Path(key_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            reason = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
            raise ValueError(
                f"--api-key-file {key_file!r} cannot be read ({reason}): give a readable file "
                "whose first line is the key"
            ) from None
        key = text.strip().splitlines()[0].strip() if text.strip() else ""
        if not key:
            raise ValueError(
                f"--api-key-file {key_file!r} is empty: write the key on its first line"
            )
        return key
    if API_KEY_ENV in environ:
        key = environ[API_KEY_ENV].strip()
        if not key:
            raise ValueError(
                f"{API_KEY_ENV} is set but empty: give it a key, or unset it to serve without one"
            )
        return key
    return None
