"""OpenAI-style error objects: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status.

Every failure path of the server ends here. Messages name the problem (the field, the limit, the
value) and never carry a traceback or a file path; unexpected exceptions become a generic 500 and
are logged server-side only. Messages are written here, not copied from exceptions: a library's
exception text can hold anything (a tokenizer's repr quotes its folder under the cache directory).
A value the client sent is quoted through `echo`, which cuts it short (a 100 KB model name must
not come back as a 100 KB error), and APIError cuts any message longer than _MAX_MESSAGE_CHARS.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("kvserve.server")

_TYPE_BY_STATUS = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
    415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
    503: "service_unavailable_error",
}


_ECHO_CHARS = 64            # a client value quoted in a message: this many characters, then its length
_MAX_MESSAGE_CHARS = 1000   # the backstop for a message that quotes too much anyway
_MAX_PARAM_CHARS = 200


def echo(value: object, limit: int = _ECHO_CHARS) -> str:
    """A value the client sent, as a message quotes it: strings repr'd; anything longer than
    `limit` characters cut there, with its full length."""
    text = value if isinstance(value, str) else str(value)
    shown = repr(text[:limit]) if isinstance(value, str) else text[:limit]
    return shown if len(text) <= limit else f"{shown}... ({len(text)} characters)"


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


class APIError(Exception):
    def __init__(self, status_code: int, message: str, *, param: Optional[str] = None,
                 code: Optional[str] = None, type: Optional[str] = None) -> None:
        message = _cut(message, _MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = _cut(param, _MAX_PARAM_CHARS) if param is not None else None
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status_code, "server_error" if status_code >= 500
                                                else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: Optional[str] = None, code: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_value_error(exc: ValueError, default_param: Optional[str] = None) -> APIError:
    """SamplingParams / the engine raise ValueErrors whose message starts with the bad field's name."""
    import dataclasses

    from kvserve.sampling_params import SamplingParams
    from kvserve.server.structured_fields import SOURCES
    message = str(exc) or "invalid request"
    first_word = message.split(" ", 1)[0]
    fields = {f.name for f in dataclasses.fields(SamplingParams)} | set(SOURCES)
    param = first_word if first_word in fields else default_param
    code = "context_length_exceeded" if "max_model_len" in message else None
    return APIError(400, message, param=param, code=code)


def format_validation_errors(errors: list[dict[str, Any]]) -> APIError:
    """pydantic errors -> one 400 naming each bad field (`messages.0.role: Input should be ...`).
    A recognised but unsupported field (protocol.UNSUPPORTED_ERROR) is named with its own message."""
    from kvserve.server.protocol import UNION_HINTS, UNSUPPORTED_ERROR
    parts: list[str] = []
    params: list[str] = []
    for err in errors:
        # Locations can hold the client's own dict keys: cut each part short.
        loc = [_cut(str(p), _ECHO_CHARS) for p in err.get("loc", ()) if p != "body"]
        tag = next((i for i, p in enumerate(loc) if _is_type_tag(p)), None)
        if err.get("type") == UNSUPPORTED_ERROR:
            loc.append(err["ctx"]["field"])
            message = str(err.get("msg"))
        elif tag is not None:
            # A union field: pydantic reports one error per member; say once what the field takes.
            loc = loc[:tag]
            message = UNION_HINTS.get(loc[-1] if loc else "", "has the wrong type")
        elif err.get("type") == "missing":
            message = "field required"
        else:
            message = str(err.get("msg", "invalid value"))
        param = ".".join(loc)
        text = f"{param}: {message}" if param else message
        if text in parts:
            continue
        parts.append(text)
        params.append(param)
    shown = parts[:5]
    more = f" (and {len(parts) - 5} more)" if len(parts) > 5 else ""
    kinds = {err.get("type") for err in errors}
    if kinds == {"missing"}:
        code = "missing_required_field"
    elif kinds == {UNSUPPORTED_ERROR}:
        code = "unsupported"
    else:
        code = "invalid_type"
    return APIError(400, "invalid request: " + "; ".join(shown) + more, param=(params[0] or None) if params else None,
                    code=code)


def _is_type_tag(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "none"} or "[" in part or part[:1].isupper()


def install_error_handlers(app: FastAPI, on_error=None) -> None:
    """Routes every exception class a request can raise to an OpenAI-style JSON error."""

    def respond(error: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(error.status_code)
        headers = {"WWW-Authenticate": "Bearer"} if error.status_code == 401 else None
        return JSONResponse(error.body(), status_code=error.status_code, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(format_validation_errors(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            detail = "no such endpoint: see /docs or /openapi.json for the API"
        return respond(APIError(exc.status_code, detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return respond(APIError(500, "internal server error", type="server_error"))
