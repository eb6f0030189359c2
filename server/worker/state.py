"""What one media worker (or the server running alone) holds, handed to its request
handlers through the aiohttp app."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from inference.engine import Manifest
from inference.service import Inference
from server.config import Settings
from server.load import LoopLoad
from server.media.avatars import AvatarStore
from server.media.sessions import SessionManager
from server.metrics import Metrics


@dataclass
class ServerState:
    settings: Settings
    runtime: str  # the runtime engine.runtime resolved to ("auto" picks one)
    manifest: Manifest
    inference: Inference  # the shared scheduler and the engine, here or in their process
    avatars: AvatarStore
    sessions: SessionManager
    metrics: Metrics
    loop_load: LoopLoad


state_key: web.AppKey[ServerState] = web.AppKey("state", ServerState)
