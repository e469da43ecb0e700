"""Errors in OpenAI's schema: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server answers goes through here, FastAPI's own included (its 422 for a body
that does not validate becomes a 400 whose ``param`` is the field's path, its 404/405 keep their
status), so a client only ever parses one shape. Handlers raise ``APIError``; an unexpected
exception becomes a 500 that hides details. Codes: ``invalid_value``, ``invalid_json``,
``unknown_parameter`` (a field nobody defines), ``unsupported_parameter`` (an OpenAI field kiln
does not implement). Messages and params are made encodable first: they may quote the client.
"""

from __future__ import annotations

import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.engine.streams import EngineDeadError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    408: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",  # OpenAI's type for "slow down": the server's queue is full
    500: "server_error",
    503: "server_error",
}


def served_routes(app) -> str:
    """Every route the app serves, as ``METHOD /path``, for the 404 and 405 messages."""
    return ", ".join(f"{method} {route.path}" for route in app.routes if isinstance(route, APIRoute)
                     for method in sorted(route.methods - {"HEAD"}))


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
    return {"error": {"message": _encodable(message), "type": kind, "param": _encodable(param), "code": code}}


def _encodable(text: Optional[str]) -> Optional[str]:
    # A lone surrogate the client sent (an unknown field's name, a model name) would make the JSON
    # encoder raise; shown as its escape instead.
    return text if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


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
        # A full queue drains in about a step per token queued; one second is a polite first retry.
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc), None, "engine_unavailable")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        return validation_error_response(errors[0] if errors else {})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"there is no route {request.method} {request.url.path}; kiln serves {served_routes(request.app)}"
        elif exc.status_code == 405:
            message = f"{request.url.path} does not take {request.method}; kiln serves {served_routes(request.app)}"
        return error_response(exc.status_code, message, None, None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error for %s %s", request.method, request.url.path)
        return error_response(500, "internal server error", None, "internal_error")


def validation_error_response(error: dict) -> JSONResponse:
    """The 400 for the first error pydantic found in a request body."""
    kind = error.get("type")
    if kind == "json_invalid":
        reason = error.get("ctx", {}).get("error") or error.get("msg", "")
        return error_response(400, f"the request body is not valid JSON: {reason}", None, "invalid_json")
    loc = [str(p) for p in error.get("loc", ()) if p != "body"]
    # Union members repeat the location with their type name; keep the field path only.
    param = ".".join(p for p in loc if not _is_type_tag(p)) or None
    message = error.get("msg", "invalid request")
    if kind == "string_unicode":  # a lone surrogate where pydantic itself needs the text (a key)
        return error_response(400, f"{param or 'the request'} holds text that is not valid Unicode; send text "
                              "without lone surrogates", param, "invalid_value")
    if param is None:
        if kind == "missing":
            return error_response(400, "the request has no body; send a JSON object", None, "invalid_value")
        return error_response(400, f"the request body must be a JSON object: {message}", None, "invalid_value")
    if kind == "extra_forbidden":
        return error_response(400, f"unknown field `{param}`: neither OpenAI's API nor kiln defines it; remove it",
                              param, "unknown_parameter")
    if kind == "not_implemented":  # the message names the field already
        return error_response(400, message if "." not in param else f"{param}: {message}", param,
                              "unsupported_parameter")
    return error_response(400, f"{param}: {message}", param, "invalid_value")


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool")
