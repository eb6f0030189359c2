"""What a session costs this host, measured at start-up with real sessions.

Admission charges each new session at what a 256x256 session has been measured to cost
the server's cores (``CostModel``). Until its own sessions have settled, a server knows
only the prior ``session.cores_per_session``, measured on other hosts: a burst of offers
on a fresh server would be admitted on a guess, too many on a slower host and too few on
a faster one. So before the front door reports ready it runs a few sessions against
itself, through the whole path a client's session takes (signalling, ICE and DTLS,
inbound Opus, features, the shared scheduler and engine, the encoders, RTP out), and
takes what they cost from the CPU time of its own processes. Its peers run in a process
of their own (``server.client.calibration``), whose CPU is not counted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import sys
from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import web

from server.config import Settings
from server.costs import session_cost
from server.front_door.admission import Admission
from server.http.access import same_secret
from server.load import SETTLED_S, cores_used

log = logging.getLogger(__name__)

#: Sent with the peers' offers: the front door takes only these while it measures.
TOKEN_HEADER = "X-Sonic-Calibration"
#: The server's idle cores are read over IDLE_S, its sessions' once all have settled over
#: MEASURE_S; it gives up after TIMEOUT_S, and the prior stands.
IDLE_S = 1.5
MEASURE_S = 3.0
TIMEOUT_S = 60.0
#: How many sessions it runs, at least and at most.
SESSIONS = (2, 24)


class CalibrationFailed(RuntimeError):
    pass


class Calibration:
    """While ``running``, only the calibration's own peers (their offers carrying its
    token) are given sessions; ``result`` then holds what it measured, or why not."""

    def __init__(self, settings: Settings, admission: Admission,
                 pids: Callable[[], Iterable[int]]) -> None:
        self.settings = settings
        self.admission = admission
        self.pids = pids
        self.running = settings.session.calibration_sessions >= 0
        self.result: dict[str, Any] | None = None
        self._token = secrets.token_urlsafe(16)

    def is_own_peer(self, request: web.Request) -> bool:
        return same_secret(request.headers.get(TOKEN_HEADER, ""), self._token)

    async def run(self) -> None:
        """Measures what a session costs this host before taking clients' sessions; on
        any failure the prior stands, and the server serves."""
        prior = self.admission.host_model.unit
        try:
            self.result = await asyncio.wait_for(self._measure(), TIMEOUT_S)
        except (CalibrationFailed, TimeoutError, OSError, ValueError) as exc:
            reason = str(exc) or f"not done within {TIMEOUT_S:g} s"
            self.result = {"error": reason}
            log.warning("start-up calibration failed (%s): a 256x256 session is taken to "
                        "cost %.3f cores (session.cores_per_session) until measured",
                        reason, prior)
        else:
            log.info("start-up calibration: %d sessions at %dx%d, %.3f cores a 256x256 "
                     "session (the prior was %.3f), %.2f cores idle, %.1f fps at least",
                     self.result["sessions"], self.settings.video.size,
                     self.settings.video.size, self.result["cores_per_session"], prior,
                     self.result["idle_cores"], self.result["fps_min"])
        finally:
            self.running = False

    def sessions(self, admits: int) -> int:
        """As set, or a quarter of what the prior and the engine (``admits``) would admit:
        enough for a reading well above the idle server's noise, few enough for any host
        to carry; never more than ``session.max_sessions``."""
        s = self.settings.session
        prior = self.admission.cores * s.max_host_load / (
            s.cores_per_session * session_cost(self.settings.video.size))
        low, high = SESSIONS
        wanted = s.calibration_sessions or min(high, max(low, min(prior, admits) // 4))
        return int(min(wanted, s.max_sessions))

    def _peers(self, sessions: int, seconds: float) -> tuple[list[str], dict[str, str]]:
        """The peers' command line, and the headers they must send (the token, the first
        API key, the first Host this server answers to)."""
        http = self.settings.http
        host = "127.0.0.1" if http.host in ("", "0.0.0.0", "::") else http.host
        host = f"[{host}]" if ":" in host else host
        command = [sys.executable, "-m", "server.client.calibration",
                   f"http://{host}:{http.port}", "--sessions", str(sessions),
                   "--seconds", str(seconds)]
        for address in self.settings.ice.host_addresses:
            command += ["--ice-host", address]
        headers = {TOKEN_HEADER: self._token}
        if http.api_keys:
            headers["Authorization"] = f"Bearer {http.api_keys[0]}"
        if http.allowed_hosts:
            headers["Host"] = http.allowed_hosts[0]
        return command, headers

    async def _settled_cost(self) -> float:
        return sum(load.settled_cost for load in await self.admission.loads())

    async def _measure(self) -> dict[str, Any]:
        """Idle cores, then ``sessions`` real sessions' cores once all have settled, from
        the CPU time of the server's processes (not their peers')."""
        size = self.settings.video.size
        sessions = self.sessions(self.admission.session_capacity(await self.admission.loads()))
        # Long enough for the last answered to settle and be measured with the first.
        seconds = 3 * SETTLED_S + MEASURE_S
        log.info("start-up calibration: measuring what a session costs this host with %d "
                 "sessions of its own (about %.0f s; until then offers are answered 503 "
                 "calibrating)", sessions, IDLE_S + seconds + 2)
        idle = await cores_used(self.pids, IDLE_S)
        command, headers = self._peers(sessions, seconds)
        peers = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        assert peers.stdin is not None
        peers.stdin.write(json.dumps(headers).encode() + b"\n")
        await peers.stdin.drain()
        peers.stdin.close()
        try:
            cost = sessions * session_cost(size)
            while await self._settled_cost() < cost - 1e-9:
                if peers.returncode is not None:
                    _, err = await peers.communicate()
                    raise CalibrationFailed(f"its peers ended before their {sessions} "
                                            f"sessions had settled: {err.decode()[-500:]}")
                await asyncio.sleep(0.25)
            busy = await cores_used(self.pids, MEASURE_S)
            if await self._settled_cost() < cost - 1e-9:
                raise CalibrationFailed("sessions ended while they were measured")
            out, err = await peers.communicate()
        finally:
            if peers.returncode is None:
                peers.kill()
                await peers.wait()
        if peers.returncode != 0:
            raise CalibrationFailed(f"its peers failed: {err.decode()[-500:]}")
        fps = json.loads(out)["video_fps"]
        if min(fps) < 24:
            log.warning("start-up calibration: the host carried %d sessions at %.1f fps at "
                        "least, below 24: what they cost is a floor", sessions, min(fps))
        unit = max(0.001, (busy - idle) / cost)
        self.admission.host_model.calibrate(idle, unit)
        while sum(load.count for load in await self.admission.loads()):  # peers hung up
            await asyncio.sleep(0.1)
        return {"sessions": sessions, "size": size, "cores_per_session": round(unit, 4),
                "idle_cores": round(idle, 3), "busy_cores": round(busy, 3),
                "fps_min": round(min(fps), 2)}
