"""Errors in OpenAI's schema: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server answers goes through here, FastAPI's own included (its 422 for a body
that does not validate becomes a 400, its 404/405 keep their status), so a client only ever parses
one shape. Handlers raise ``APIError``; an unexpected exception becomes a 500 that hides details.
"""

from __future__ import annotations

import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.runtime.async_engine import EngineDeadError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                   headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def bad_request(message: str, param: Optional[str] = None) -> APIError:
    return APIError(400, message, param, "invalid_value")


def engine_unavailable(message: str) -> APIError:
    return APIError(503, message, None, "engine_unavailable")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc), None, "engine_unavailable")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {first.get('msg', '')}",
                                  None, "invalid_json")
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        # Union members repeat the location with their type name; keep the field path only.
        param = ".".join(p for p in loc if not _is_type_tag(p)) or None
        message = first.get("msg", "invalid request")
        if param:
            message = f"{param}: {message}"
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), None, None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error for %s %s", request.method, request.url.path)
        return error_response(500, "internal server error", None, "internal_error")


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool")
