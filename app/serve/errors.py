"""OpenAI-style API errors: ``{"error": {"message", "type", "param", "code"}}`` with a status."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          503: "server_error", 500: "server_error"}


class APIError(Exception):
    """A request the server answers with an error status and body instead of a completion."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
