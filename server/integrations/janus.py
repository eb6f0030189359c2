"""The avatar in a Janus VideoRoom: it listens to one participant and publishes itself.

A session made with ``"janus": {"room", "listen_to"}`` joins the room on the configured
Janus gateway (``janus.url``) as a publisher of its video and delayed audio, and takes one
named participant's published audio as its driving speech, subscribing whenever that
participant publishes (they may join after the avatar, leave and come back). Janus's REST
API carries the signalling: requests are posted, events come back on a long poll. Both
peer connections are aiortc's, with the server's ICE settings; the SDPs carry every
candidate (Janus runs half-trickle), so nothing is trickled but the end of candidates.

The session ends the presence (the Janus session is destroyed, which leaves the room), and
the presence ends the session when Janus stops answering or the room connection fails.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from typing import Any

import aiohttp
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamTrack

from server.config import IceSettings, JanusSettings
from server.media.audio_ingest import decode_on_loop
from server.media.peer import rtc_configuration, send_session
from server.media.session import Session
from server.session_spec import RoomRequest

log = logging.getLogger(__name__)

PLUGIN = "janus.plugin.videoroom"
#: Janus drops a session after 60 s without a request; a keepalive goes this often.
KEEPALIVE_S = 25.0
#: A long poll that Janus holds open returns after 30 s with a keepalive of its own.
POLL_TIMEOUT_S = 40.0
#: Failed polls in a row after which Janus counts as gone.
POLL_FAILURES = 3
#: VideoRoom error codes (janus_videoroom.c) that mean the request named a wrong room.
NO_SUCH_ROOM = 426
UNAUTHORIZED = 433


class JanusError(Exception):
    """Janus refused a request or could not be reached; ``code`` names which for the API."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class JanusApi:
    """One Janus session over the REST API: requests with transactions, a long poll for
    events, keepalives. Events that answer a transaction resolve it; the rest go to the
    handle they came from."""

    def __init__(self, settings: JanusSettings) -> None:
        self._settings = settings
        self._http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=settings.timeout_s))
        self._session_url = ""
        self._pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._handlers: dict[int, asyncio.Queue[dict[str, Any]]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._ids = itertools.count()
        self.lost = asyncio.Event()  # set when Janus stops answering

    def _transaction(self) -> str:
        return f"t{next(self._ids)}-{secrets.token_hex(4)}"

    async def _post(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        body = {"transaction": self._transaction(), **body}
        if self._settings.api_secret:
            body["apisecret"] = self._settings.api_secret
        try:
            async with self._http.post(url, json=body) as response:
                reply = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise JanusError("janus_unreachable",
                             f"Janus at {self._settings.url} did not answer: "
                             f"{exc or type(exc).__name__}") from None
        if not isinstance(reply, dict):
            raise JanusError("janus_error", f"Janus answered {reply!r}")
        if reply.get("janus") == "error":
            error = reply.get("error") or {}
            raise JanusError("janus_error", f"Janus refused {body['janus']!r}: "
                             f"{error.get('reason')} ({error.get('code')})")
        reply["transaction"] = body["transaction"]
        return reply

    async def open(self) -> None:
        reply = await self._post(self._settings.url, {"janus": "create"})
        self._session_url = f"{self._settings.url.rstrip('/')}/{reply['data']['id']}"
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._poll()), loop.create_task(self._keepalive())]

    async def attach(self) -> int:
        reply = await self._post(self._session_url, {"janus": "attach", "plugin": PLUGIN})
        handle = int(reply["data"]["id"])
        self._handlers[handle] = asyncio.Queue()
        return handle

    async def detach(self, handle: int) -> None:
        self._handlers.pop(handle, None)
        try:
            await self._post(f"{self._session_url}/{handle}", {"janus": "detach"})
        except JanusError:
            pass  # gone with its session already

    async def request(self, handle: int, body: dict[str, Any],
                      jsep: dict[str, str] | None = None) -> dict[str, Any]:
        """A plugin request; its answer (given at once, or later as an event), as
        ``{"data": plugin data, "jsep": ...}``. A VideoRoom error raises."""
        transaction = self._transaction()
        message: dict[str, Any] = {"janus": "message", "body": body,
                                   "transaction": transaction}
        if jsep is not None:
            message["jsep"] = jsep
        # Registered first: the poll may bring the answer before the post's "ack" is read.
        future = self._pending[transaction] = asyncio.get_running_loop().create_future()
        try:
            reply = await self._post(f"{self._session_url}/{handle}", message)
            if reply.get("janus") == "ack":
                reply = await asyncio.wait_for(future, self._settings.timeout_s)
        except TimeoutError:
            raise JanusError("janus_timeout", f"Janus gave no answer to "
                             f"{body.get('request')!r} in {self._settings.timeout_s} s"
                             ) from None
        finally:
            self._pending.pop(transaction, None)
        data = (reply.get("plugindata") or {}).get("data") or {}
        if "error_code" in data:
            code = {NO_SUCH_ROOM: "unknown_room", UNAUTHORIZED: "room_refused"}.get(
                data["error_code"], "janus_error")
            raise JanusError(code, f"Janus VideoRoom refused {body.get('request')!r}: "
                             f"{data.get('error')} ({data['error_code']})")
        return {"data": data, "jsep": reply.get("jsep")}

    async def trickle_done(self, handle: int) -> None:
        await self._post(f"{self._session_url}/{handle}",
                         {"janus": "trickle", "candidate": {"completed": True}})

    async def next_event(self, handle: int) -> dict[str, Any]:
        return await self._handlers[handle].get()

    async def _poll(self) -> None:
        failures = 0
        while failures < POLL_FAILURES:
            params = {"maxev": "10", "rid": str(next(self._ids))}
            if self._settings.api_secret:
                params["apisecret"] = self._settings.api_secret
            try:
                async with self._http.get(self._session_url, params=params,
                                          timeout=aiohttp.ClientTimeout(POLL_TIMEOUT_S)
                                          ) as response:
                    events = await response.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                failures += 1
                log.info("Janus poll failed (%d of %d): %s", failures, POLL_FAILURES, exc)
                await asyncio.sleep(0.5 * failures)
                continue
            failures = 0
            for event in events if isinstance(events, list) else [events]:
                if isinstance(event, dict):
                    self._dispatch(event)
                    if event.get("janus") == "error":  # our Janus session is gone
                        failures = POLL_FAILURES
        self.lost.set()

    def _dispatch(self, event: dict[str, Any]) -> None:
        future = self._pending.get(event.get("transaction", ""))
        if future is not None and not future.done() and event.get("janus") == "event":
            future.set_result(event)
            return
        queue = self._handlers.get(event.get("sender", -1))
        if queue is not None:
            queue.put_nowait(event)

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(KEEPALIVE_S)
            try:
                await self._post(self._session_url, {"janus": "keepalive"})
            except JanusError as exc:
                log.info("Janus keepalive failed: %s", exc)

    async def close(self) -> None:
        """Destroy the Janus session (its handles leave the room with it)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session_url and not self._http.closed:
            try:
                await self._post(self._session_url, {"janus": "destroy"})
            except JanusError:
                pass
        self._session_url = ""
        await self._http.close()


class RoomPresence:
    """One session's avatar in one VideoRoom (see the module's docstring)."""

    def __init__(self, session: Session, request: RoomRequest, settings: JanusSettings,
                 ice: IceSettings, codec: str) -> None:
        self.session = session
        self.request = request
        self._ice = ice
        self._codec = codec
        self._api = JanusApi(settings)
        self._publisher_handle = 0
        self._publisher_pc: RTCPeerConnection | None = None
        self._tracks: list[MediaStreamTrack] = []
        self._listening: tuple[int, int, RTCPeerConnection] | None = None  # feed, handle, pc
        self._task: asyncio.Task[None] | None = None
        self.publisher_id: int | None = None

    def describe(self) -> dict[str, Any]:
        return {"sfu": "janus", "room": self.request.room, "display": self.request.display,
                "publisher_id": self.publisher_id, "listen_to": self.request.listen_to,
                "listening": self._listening is not None}

    async def join(self) -> None:
        """Join and publish, and subscribe if the participant is already publishing;
        raises ``JanusError`` (leaving nothing behind) if Janus or the room says no."""
        try:
            await self._api.open()
            self._publisher_handle = await self._api.attach()
            body: dict[str, Any] = {"request": "join", "ptype": "publisher",
                                    "room": self.request.room, "display": self.request.display}
            if self.request.pin is not None:
                body["pin"] = self.request.pin
            joined = (await self._api.request(self._publisher_handle, body))["data"]
            self.publisher_id = joined.get("id")
            await self._publish()
        except BaseException:
            await self.leave()
            raise
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._follow(joined.get("publishers") or []))
        self.session.on_close(lambda _: self.leave())

    async def _publish(self) -> None:
        pc = RTCPeerConnection(rtc_configuration(self._ice))
        self._publisher_pc = pc
        self._tracks = send_session(pc, self.session, self._codec)

        @pc.on("connectionstatechange")
        async def on_state() -> None:
            self.session.peer_state(pc.connectionState)
            if pc.connectionState in ("failed", "closed"):
                self.session.close_soon(f"room connection {pc.connectionState}")

        await pc.setLocalDescription(await pc.createOffer())
        answer = await self._api.request(
            self._publisher_handle, {"request": "publish", "display": self.request.display},
            {"type": "offer", "sdp": pc.localDescription.sdp})
        await self._api.trickle_done(self._publisher_handle)
        jsep = answer["jsep"] or {}
        if jsep.get("type") != "answer":
            raise JanusError("janus_error", "Janus answered the avatar's offer without SDP")
        await pc.setRemoteDescription(RTCSessionDescription(jsep["sdp"], "answer"))

    async def _follow(self, publishers: list[dict[str, Any]]) -> None:
        """Subscribe to the participant whenever they publish, drop them when they stop,
        and end the session if Janus goes."""
        lost = asyncio.get_running_loop().create_task(self._api.lost.wait())
        try:
            await self._consider(publishers)
            while True:
                event = asyncio.get_running_loop().create_task(
                    self._api.next_event(self._publisher_handle))
                done, _ = await asyncio.wait({event, lost},
                                             return_when=asyncio.FIRST_COMPLETED)
                if lost in done:
                    event.cancel()
                    self.session.close_soon("room lost: Janus stopped answering")
                    return
                message = event.result()
                if message.get("janus") == "hangup":
                    self.session.close_soon("room lost: Janus hung up the avatar")
                    return
                data = (message.get("plugindata") or {}).get("data") or {}
                await self._consider(data.get("publishers") or [])
                gone = data.get("unpublished", data.get("leaving"))
                if self._listening is not None and gone == self._listening[0]:
                    log.info("session %s: %s stopped publishing", self.session.id,
                             self.request.listen_to)
                    await self._unsubscribe()
        except JanusError as exc:
            log.warning("session %s: room %s: %s", self.session.id, self.request.room, exc)
            self.session.close_soon(f"room lost: {exc}")
        finally:
            lost.cancel()

    async def _consider(self, publishers: list[dict[str, Any]]) -> None:
        if self._listening is not None:
            return
        for publisher in publishers:
            audio = [s for s in publisher.get("streams") or []
                     if s.get("type") == "audio" and not s.get("disabled")]
            if publisher.get("display") == self.request.listen_to and audio:
                try:
                    await self._subscribe(int(publisher["id"]), str(audio[0]["mid"]))
                except JanusError as exc:  # gone again, say: wait for them to publish
                    log.warning("session %s: could not listen to %s: %s", self.session.id,
                                self.request.listen_to, exc)
                return

    async def _subscribe(self, feed: int, mid: str) -> None:
        handle = await self._api.attach()
        pc = RTCPeerConnection(rtc_configuration(self._ice))

        @pc.on("track")
        def on_track(track: MediaStreamTrack) -> None:
            if track.kind == "audio":
                decode_on_loop(pc, track)
                self.session.add_audio_track(track)

        body: dict[str, Any] = {"request": "join", "ptype": "subscriber",
                                "room": self.request.room,
                                "streams": [{"feed": feed, "mid": mid}]}
        if self.request.pin is not None:
            body["pin"] = self.request.pin
        try:
            offer = await self._api.request(handle, body)
            jsep = offer["jsep"] or {}
            if jsep.get("type") != "offer":
                raise JanusError("janus_error", "Janus offered the participant without SDP")
            await pc.setRemoteDescription(RTCSessionDescription(jsep["sdp"], "offer"))
            await pc.setLocalDescription(await pc.createAnswer())
            await self._api.request(handle, {"request": "start"},
                                    {"type": "answer", "sdp": pc.localDescription.sdp})
            await self._api.trickle_done(handle)
        except BaseException:
            await pc.close()
            await self._api.detach(handle)
            raise
        self._listening = (feed, handle, pc)
        log.info("session %s: listening to %s (feed %s) in room %s", self.session.id,
                 self.request.listen_to, feed, self.request.room)

    async def _unsubscribe(self) -> None:
        if self._listening is None:
            return
        _, handle, pc = self._listening
        self._listening = None
        await pc.close()
        await self._api.detach(handle)

    async def leave(self) -> None:
        """Leave the room: idempotent, and safe half-way through joining."""
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        for track in self._tracks:
            track.stop()
        await self._unsubscribe()
        if self._publisher_pc is not None:
            await self._publisher_pc.close()
            self._publisher_pc = None
        await self._api.close()
