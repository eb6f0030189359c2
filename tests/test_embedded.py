"""The whole server in one process (``workers.embedded = true``): the same API as the
front door's, from the same table, and none of the routes only the front door may call."""

from __future__ import annotations

import pytest
from conftest import ServerProcess, call_json

from server.client.peer import run_session

pytestmark = pytest.mark.e2e


async def test_a_server_alone_serves_a_session_and_keeps_its_internal_routes_closed(speech_wav):
    with ServerProcess("--set", "workers.embedded=true") as server:
        status, health = await call_json("GET", f"{server.url}/healthz")
        assert status == 200 and health["status"] == "ok" and "workers" not in health
        received = await run_session(server.url, str(speech_wav), seconds=4, keep=False)
        assert received.video_fps() >= 24.0, received.video_fps()
        status, made = await call_json("POST", f"{server.url}/sessions", {})
        assert status == 201 and made["urls"]["viewer_page"].startswith("/?session=")
        for method, path in (("GET", "/internal/load"), ("POST", "/internal/sessions")):
            status, answer = await call_json(method, f"{server.url}{path}", {})
            assert status in (404, 405) and answer["error"], (path, answer)
        status, document = await call_json("GET", f"{server.url}/openapi.json")
        assert status == 200 and "/sessions/{session_id}/whep" in document["paths"]
