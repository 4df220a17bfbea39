"""The error a request gets: an HTTP status and vLLM's JSON error body. Its own module, without
pydantic, so that the length rules (limits.py) and the flags that use them load light in the
engine core process."""
from __future__ import annotations

ERROR_TYPES = {400: "BadRequestError", 401: "Unauthorized", 404: "NotFoundError", 409: "ConflictError",
               413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}
