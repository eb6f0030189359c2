"""What every application of this server (the front door's, a media worker's) holds for
the HTTP layer to read: the settings in force, the metrics, who may call."""

from __future__ import annotations

from aiohttp import web

from server.config import Settings
from server.http.access import Access
from server.metrics import Metrics

settings_key: web.AppKey[Settings] = web.AppKey("settings", Settings)
metrics_key: web.AppKey[Metrics] = web.AppKey("metrics", Metrics)
access_key: web.AppKey[Access] = web.AppKey("access", Access)
