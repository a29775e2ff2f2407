"""The one error type that crosses layers and becomes an OpenAI-style error body.

Any layer raises ``RouterError(status, message, ...)`` for bad input or an unusable
upstream; ``api`` turns it into ``{"error": {"message", "type", "param", "code"}}``
with the given HTTP status. Anything else reaching the api is a bug (500, logged).
"""

from __future__ import annotations

from typing import Any

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "TimeoutError",
    413: "BadRequestError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class RouterError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        err_type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.err_type = err_type or _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code or self.status}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> RouterError:
    return RouterError(400, message, param=param, code=code)
