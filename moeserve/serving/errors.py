"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Handlers turn every failure the server can meet into one of these, with the right status:
400 for anything wrong with the request (the message names the field), 401 for the API key,
404 for an unknown path, 413 for a body over the limit, 503 with Retry-After for a full queue
or a server shutting down, 500 only for our own bugs (``guard.py`` logs those with their
traceback and answers without the exception's text).
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeserve.serving.protocol import ErrorInfo, ErrorResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    422: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error answered as is: status, message, the offending field, a machine code."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        info = ErrorInfo(
            message=self.message,
            type=_TYPES.get(self.status, "APIError"),
            param=self.param,
            code=self.code,
        )
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code or "invalid_request")


def quoted(value: str, limit: int = 80) -> str:
    """``repr(value)`` cut to about ``limit`` characters: what a message may echo of the
    client's input (an error must not grow with it)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...' ({len(value)} characters)"


def _field(loc: tuple) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``messages[0].content``; None for the body."""
    parts = [p for p in loc if p != "body"]
    # pydantic adds the union member's type to the location (e.g. "list[int]"): drop it
    parts = [p for p in parts if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS))]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "constrained-str"}


def validation_error(exc: RequestValidationError, body: bytes | None) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first.get('msg')}", code="invalid_json")
    field = _field(tuple(first.get("loc", ())))
    if field is None and body is not None:
        try:
            json.loads(body)
        except UnicodeDecodeError:
            return bad_request("the body is not valid UTF-8", code="invalid_utf8")
        except ValueError:
            pass
    msg = first.get("msg", "invalid value")
    where = f"'{field}'" if field else "the body"
    extra = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return bad_request(f"{where}: {msg}{extra}", param=field)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        body = await request.body()
        return validation_error(exc, body).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # FastAPI could not parse the body (e.g. bad UTF-8)
            body = await request.body()
            try:
                body.decode("utf-8")
            except UnicodeDecodeError:
                return bad_request("the body is not valid UTF-8", code="invalid_utf8").response()
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return APIError(exc.status_code, detail, headers=exc.headers).response()
