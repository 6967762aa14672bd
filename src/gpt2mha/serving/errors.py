"""The error every route answers with: OpenAI's ``{"error": {...}}`` and an HTTP status
(used by :mod:`.protocol` and the modules it calls alike)."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def body(self) -> dict:
        """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The error as a JSON response with its status and headers."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
