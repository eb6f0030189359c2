"""HTTP calls a client makes of a server that may have just started: for its first
seconds it measures what a session costs, answering 503 ``calibrating``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

#: The longest a client waits for a server that has just started to take sessions.
START_WAIT_S = 60.0


#: Answers that say "not now, soon": the server's start-up calibration, and this address's
#: other offers still being answered.
WAIT_OUT = frozenset({(503, "calibrating"), (429, "too_many_offers")})


async def post_once_ready(http: aiohttp.ClientSession, url: str, body: dict[str, Any]
                          ) -> tuple[int, Any]:
    """POST ``body``; while the server answers 503 ``calibrating`` (for its first seconds it
    measures what a session costs) or 429 ``too_many_offers`` (this address's other offers
    are being answered), ask again as its ``Retry-After`` says, up to ``START_WAIT_S``.
    Any other answer is returned as it came."""
    give_up_at = time.monotonic() + START_WAIT_S
    while True:
        async with http.post(url, json=body) as response:
            answer = await response.json()
            if (response.status, answer.get("error")) not in WAIT_OUT \
                    or time.monotonic() > give_up_at:
                return response.status, answer
            delay = float(response.headers.get("Retry-After", 5))
        await asyncio.sleep(delay)
