"""vLLM's answers that several routes share: error bodies in vLLM's shapes, usage, and
reading request bodies the way vLLM's FastAPI handlers do.

Plain answers are encoded by aiohttp's ``json_response`` (the standard library's
``json.dumps``, like vLLM's), which fixes their bytes: keep it.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from asyncsync._core import encoding as _json


def collective(message: str) -> str:
    """The message of a failed collective RPC (a worker raised ``message``)."""
    return (
        f"Call to collective_rpc method failed: Worker failed with error '{message}', "
        "please check the stack trace above for the root cause"
    )


def openai_body(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def openai_error(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}``."""
    return web.json_response(openai_body(status, message, kind, param), status=status)


def bad_request(message: str) -> web.Response:
    """A generation request vLLM refuses (400 ``BadRequestError``)."""
    return openai_error(400, message, "BadRequestError")


def validation_error(
    loc: str, kind: str, msg: str, value: Any, ctx: str | None = None
) -> web.Response:
    """vLLM's rendering of a FastAPI/pydantic validation error (400, not 422)."""
    err: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": value}
    if ctx is not None:
        err["ctx"] = {"expected": ctx}
    return openai_error(400, f"1 validation error:\n  {err!r}", "Bad Request", loc)


class ClosingResponse(web.Response):
    """A response after which the connection is closed, without a ``Connection: close``
    header: what uvicorn does when an exception escapes vLLM's handlers."""


def worker_failure(message: str) -> web.Response:
    """A worker failure as vLLM sends it: 500 "Call to collective_rpc method failed: ..."
    and then the connection is closed (see `ClosingResponse`)."""
    body = openai_body(500, collective(message), "InternalServerError")
    return ClosingResponse(text=json.dumps(body), status=500, content_type="application/json")


def not_found() -> web.Response:
    return web.json_response({"detail": "Not Found"}, status=404)


def method_not_allowed() -> web.Response:
    return web.json_response({"detail": "Method Not Allowed"}, status=405)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The ``usage`` object of a generation answer."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


async def read_json(request: web.Request) -> tuple[bool, Any]:
    """``(True, value)`` for a JSON body, ``(False, None)`` for an empty or invalid one."""
    raw = await request.read()
    if not raw:
        return False, None
    try:
        return True, _json.loads(raw)
    except ValueError:
        return False, None


async def read_embedded(request: web.Request, name: str) -> tuple[Any, web.Response | None]:
    """FastAPI's ``Body(embed=True)``: ``{name: value}``; missing -> 400 validation."""
    ok, data = await read_json(request)
    if not ok or not isinstance(data, dict) or name not in data:
        return None, validation_error(f"body.{name}", "missing", "Field required", "None")
    return data[name], None
