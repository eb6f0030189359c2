"""The answers every process that serves the API gives alike (the front door, or a media
worker serving alone): the pages, the configuration, the API's own description, and what
WHIP and WHEP clients ask before they offer."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from aiohttp import web

from inference.engine import KNOBS
from server.config import REPO_ROOT, Settings
from server.http.api import openapi as openapi_document
from server.http.app_keys import settings_key

STATIC_DIR = REPO_ROOT / "static"
SDP = "application/sdp"


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html")


async def kiosk(request: web.Request) -> web.FileResponse:
    """Full screen, one named session, reconnecting by itself: ``/kiosk?name=N&token=T``."""
    return web.FileResponse(STATIC_DIR / "kiosk.html")


async def config(request: web.Request) -> web.Response:
    """The settings in force (secrets withheld) and the session knobs with their ranges:
    what operators check after overriding, and what the page builds its controls from."""
    return web.json_response(config_body(request.app[settings_key]))


def config_body(settings: Settings) -> dict[str, Any]:
    defaults = settings.session.knob_defaults()
    knobs = [{**knob.describe(), "default": defaults[knob.name]} for knob in KNOBS]
    return {"settings": settings.effective(), "knobs": knobs}


async def openapi(request: web.Request) -> web.Response:
    try:
        version = metadata.version("sonic-media-server")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return web.json_response(openapi_document(version))


async def sdp_options(request: web.Request) -> web.Response:
    """What WHIP and WHEP clients ask before offering."""
    return web.Response(status=204, headers={"Accept-Post": SDP, "Allow": "OPTIONS, POST"})


HANDLERS = {"index": index, "kiosk": kiosk, "config": config, "openapi": openapi,
            "whip_options": sdp_options, "whep_options": sdp_options}
