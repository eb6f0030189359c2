"""The API's error answer: a status and a JSON body naming the problem."""

from __future__ import annotations

import json
from typing import NoReturn

from aiohttp import web

#: Seconds a client refused for capacity is asked to wait before it tries again.
RETRY_AFTER_S = 5


class ApiError(web.HTTPException):
    """An HTTP error with a JSON body naming the problem."""

    def __init__(self, status: int, code: str, message: str,
                 headers: dict[str, str] | None = None) -> None:
        self.status_code = status
        super().__init__(text=json.dumps({"error": code, "message": message}),
                         content_type="application/json", headers=headers)
        self.code = code
        self.message = message

    def answer(self) -> web.Response:
        """The same answer as a plain response, holding nothing the exception held."""
        response = web.json_response({"error": self.code, "message": self.message},
                                     status=self.status_code,
                                     headers={k: v for k, v in self.headers.items()
                                              if k.lower() not in ("content-type",
                                                                   "content-length")})
        if self.keep_alive is False:
            response.force_close()
        return response


def shown(value: object, most: int = 64) -> str:
    """``value`` as an error message may quote it: its repr, cut to ``most`` characters (a
    client's 1 MB name is not sent back to it)."""
    text = repr(value)
    return text if len(text) <= most else f"{text[:most - 4]}...{text[-1]}"


def fail(status: int, code: str, message: str) -> NoReturn:
    raise ApiError(status, code, message)


def at_capacity(message: str, error: str = "at_capacity") -> NoReturn:
    """503 with ``Retry-After``: the server cannot take this now, and may later."""
    raise ApiError(503, error, message, headers={"Retry-After": str(RETRY_AFTER_S)})


def too_many(code: str, message: str, retry_after_s: int = RETRY_AFTER_S) -> ApiError:
    """429 with ``Retry-After``: this caller holds as many of something as it may."""
    return ApiError(429, code, message, headers={"Retry-After": str(retry_after_s)})
