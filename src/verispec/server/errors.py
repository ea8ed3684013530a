"""OpenAI-style errors, API-key check and the request-body size limit.

Every error a client sees has OpenAI's body, `{"error": {"message", "type", "param",
"code"}}`, so the official client raises its usual exception classes with our message.
"""

from __future__ import annotations

import hmac
import json

from starlette.responses import JSONResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
DEFAULT_MAX_BODY_BYTES = 8 * 2**20


class ApiError(Exception):
    """An HTTP error a handler raises; the app answers it with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def require_json(content_type: str | None) -> None:
    """POST bodies must say they are JSON. A form or text/plain POST is what any web page
    can send cross-origin without a preflight; parsing it anyway would let every page a
    user visits start generations on an open local server."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise ApiError(415, f"Content-Type must be application/json, got {content_type or 'none'!r}",
                       code="unsupported_media_type")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def authorized(header: str | None, api_key: str | None) -> bool:
    if api_key is None:
        return True
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


class BodyLimit:
    """ASGI middleware: refuse request bodies over `max_bytes` with 413, by the
    Content-Length header when there is one and by counting otherwise (chunked uploads),
    before the body is buffered."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        seen = 0
        too_big = False

        async def counting_receive():
            nonlocal seen, too_big
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    too_big = True
                    raise _BodyTooLarge()
            return message

        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._refuse(send)
        except Exception:
            if too_big and not started:
                return await self._refuse(send)
            raise

    async def _refuse(self, send):
        body = json.dumps(error_body(413, f"request body larger than {self.max_bytes} bytes")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(Exception):
    pass
