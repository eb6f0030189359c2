"""A reference aiortc client: sends a WAV as the driving speech, records what comes back.

Tests and benchmarks use it, and so can a bot. Besides the media it records the
sender reports (RTCP SR) of both returned streams, which map each stream's RTP time to
the server's wall clock: exactly what a browser uses to play lips and sound together.
So ``sender_time`` tells when the server meant each frame and each audio chunk to play.

    python -m server.client http://127.0.0.1:8080 speech.wav --seconds 10
    python -m server.client http://127.0.0.1:8080 --view SESSION TOKEN --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import fractions
import json
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple
from urllib.parse import urlparse

import aiohttp
import av
import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.contrib.media import MediaPlayer
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtcrtpreceiver import RTCRtpReceiver
from aiortc.rtp import RTCP_PSFB_APP, RtcpPsfbPacket, RtcpSrPacket, RtpPacket, pack_remb_fci

from server.encoding import SpeechOpusEncoder, join_opus
from server.peer import pin_host_addresses

RATES = {"audio": 48000, "video": 90000}
#: The longest a client waits for a server that has just started to take sessions.
START_WAIT_S = 60.0
#: Sender reports count seconds from 1900; ``time.time()`` from 1970.
NTP_EPOCH = 2208988800


@dataclass
class Stream:
    kind: str
    arrivals: list[float] = field(default_factory=list)
    pts: list[int] = field(default_factory=list)
    data: list[np.ndarray] = field(default_factory=list)
    reports: list[tuple[float, int]] = field(default_factory=list)  # (NTP seconds, RTP ts)
    rtp_origin: int | None = None

    def sender_times(self) -> np.ndarray:
        """Server wall-clock (NTP) time of each item, from the sender report nearest the
        sender's own clock (``anchor``)."""
        ntp, rtp = self.anchor()
        raw = (self.rtp_origin + np.asarray(self.pts, np.int64)) % (1 << 32)
        return ntp + _rtp_delta(raw, rtp) / RATES[self.kind]

    def anchor(self, recent: int = 8) -> tuple[float, int]:
        """Of the last ``recent`` sender reports, the one that puts the RTP clock earliest.
        A report pairs an RTP timestamp with the time its packet left (aiortc's sender
        notes it after the send), so a busy sender makes a report late, never early: one
        late by half a frame would shift every time it gives by a frame."""
        if not self.reports or self.rtp_origin is None:
            raise RuntimeError(f"no sender report received on the {self.kind} stream")
        candidates = self.reports[-recent:]
        _, last_rtp = candidates[-1]
        return min(candidates,
                   key=lambda r: r[0] - _rtp_delta(r[1], last_rtp) / RATES[self.kind])


def _rtp_delta(timestamp: Any, reference: int) -> Any:
    """``timestamp - reference`` in RTP ticks, across the 32-bit wrap."""
    return (timestamp - reference + (1 << 31)) % (1 << 32) - (1 << 31)


@dataclass
class Received:
    session_id: str
    video: Stream = field(default_factory=lambda: Stream("video"))
    audio: Stream = field(default_factory=lambda: Stream("audio"))
    answer: dict[str, Any] = field(default_factory=dict)
    coefficients: list[dict[str, Any]] = field(default_factory=list)
    coefficient_arrivals: list[float] = field(default_factory=list)

    def video_fps(self) -> float:
        return _rate(self.video.arrivals)

    def motion_fps(self) -> float:
        """Coefficient messages per second (a motion-only session's frame rate)."""
        return _rate(self.coefficient_arrivals)


def _rate(t: list[float]) -> float:
    return (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else 0.0


class Counted(NamedTuple):
    """A frame a counting peer received: its RTP time from the stream's first, as a
    decoded frame's ``pts`` would be."""

    pts: int


def count_frames(pc: RTCPeerConnection) -> None:
    """``pc`` counts the frames it receives instead of decoding them, from their RTP headers
    alone: each audio packet, and each video packet that ends a frame (the marker bit),
    reaches the track as a ``Counted``, with no jitter buffer, decoder thread or decoding.
    A load generator's peers share the machine with the server and must not be its
    bottleneck (decoding video costs 0.2-0.3 cores per stream). Its bandwidth estimate
    still goes back (REMB, as aiortc's receiver sends it), so the server encodes at the
    rate a real viewer would let it. Retransmissions are never asked for, so none come."""
    for transceiver in pc.getTransceivers():
        receiver = transceiver.receiver
        mapper = receiver._RTCRtpReceiver__timestamp_mapper  # type: ignore[attr-defined]
        estimator = receiver._RTCRtpReceiver__remote_bitrate_estimator  # type: ignore[attr-defined]

        async def counted(packet: RtpPacket, arrival_time_ms: int,
                          receiver: RTCRtpReceiver = receiver, mapper: Any = mapper,
                          estimator: Any = estimator) -> None:
            track = receiver.track
            if track is None:
                return
            if estimator is not None and packet.extensions.abs_send_time is not None:
                remb = estimator.add(abs_send_time=packet.extensions.abs_send_time,
                                     arrival_time_ms=arrival_time_ms,
                                     payload_size=len(packet.payload) + packet.padding_size,
                                     ssrc=packet.ssrc)
                ssrc = receiver._RTCRtpReceiver__rtcp_ssrc  # type: ignore[attr-defined]
                if remb is not None and ssrc is not None:
                    await receiver._send_rtcp(RtcpPsfbPacket(
                        fmt=RTCP_PSFB_APP, ssrc=ssrc, media_ssrc=0, fci=pack_remb_fci(*remb)))
            if track.kind == "audio" or packet.marker:
                track._queue.put_nowait(Counted(mapper.map(packet.timestamp)))

        receiver._handle_rtp_packet = counted  # type: ignore[method-assign]


class EncodedSpeech(MediaStreamTrack):
    """Speech sent as Opus packets encoded once, in real time and looped: what a load
    generator's peers send, so that thousands of them do not each run an encoder (and
    aiortc's, which resamples every chunk to stereo on a thread of its own)."""

    kind = "audio"

    #: One packet's speech; packets sent later than ``LATE_S`` past their time are
    #: recorded in ``late``.
    PERIOD_S = 0.02
    LATE_S = 0.002

    def __init__(self, packets: list[bytes]) -> None:
        super().__init__()
        self._packets = packets
        self._n = 0
        self._start: float | None = None
        #: 20 ms frames a packet carries: ``run_session`` sets it from the answer's
        #: ``a=ptime``, as a browser does (``asked_ptime``).
        self.frames_per_packet = 1
        self._unsent: deque[av.Packet] = deque()  # frames that could not be joined
        #: (monotonic time, seconds late) of each packet that left over ``LATE_S`` after
        #: its time: the sender's own jitter (a busy loop, then a burst to catch up), which
        #: the server's jitter buffer then holds as extra delay.
        self.late: list[tuple[float, float]] = []

    @classmethod
    def encode_wav(cls, path: str) -> list[bytes]:
        """A WAV's speech (any rate and layout) as one mono Opus packet per 20 ms."""
        resampler = av.AudioResampler(format="s16", layout="mono", rate=48000)
        with av.open(path) as container:
            return cls.encode_pcm(np.concatenate([
                out.to_ndarray().reshape(-1) for frame in container.decode(audio=0)
                for out in resampler.resample(frame)]))

    @staticmethod
    def encode_pcm(pcm: np.ndarray) -> list[bytes]:
        """Mono 48 kHz int16 speech as one Opus packet per 20 ms."""
        encoder = SpeechOpusEncoder()
        return [bytes(encoder.encode(pcm[n * 960:(n + 1) * 960], n * 960))
                for n in range(pcm.size // 960)]

    @property
    def packet_s(self) -> float:
        """Speech a packet carries, in seconds: the time between two packets."""
        return self.PERIOD_S * self.frames_per_packet

    async def recv(self) -> av.Packet:
        if self._unsent:
            return self._unsent.popleft()
        loop = asyncio.get_running_loop()
        if self._start is None:
            self._start = loop.time()
        due = self._start + self._n * self.PERIOD_S
        if due > loop.time():
            await asyncio.sleep(due - loop.time())
        if (now := loop.time()) - due > self.LATE_S:
            self.late.append((now, now - due))
        frames = [self._frame(self._n + i) for i in range(self.frames_per_packet)]
        self._n += len(frames)
        joined = join_opus(frames) if len(frames) > 1 else frames[0]
        if joined is not None:
            return joined
        self._unsent.extend(frames[1:])
        return frames[0]

    def _frame(self, n: int) -> av.Packet:
        packet = av.Packet(self._packets[n % len(self._packets)])
        packet.pts, packet.time_base = n * 960, fractions.Fraction(1, 48000)
        return packet


def asked_ptime(sdp: str) -> int | None:
    """The audio packet length (ms) an SDP asks for (``a=ptime`` in its audio section)."""
    audio = re.search(r"m=audio .*?(?=\r?\nm=|\Z)", sdp, re.S)
    found = re.search(r"^a=ptime:(\d+)", audio.group(0), re.M) if audio else None
    return int(found.group(1)) if found else None


def _watch_sender_reports(receiver: RTCRtpReceiver, stream: Stream) -> None:
    handle = receiver._handle_rtcp_packet

    async def recording(packet: Any) -> None:
        if isinstance(packet, RtcpSrPacket):
            ntp = packet.sender_info.ntp_timestamp
            stream.reports.append(((ntp >> 32) + (ntp & 0xFFFFFFFF) / 2**32,
                                   packet.sender_info.rtp_timestamp))
        await handle(packet)

    receiver._handle_rtcp_packet = recording  # type: ignore[method-assign]


async def _consume(track: MediaStreamTrack, receiver: RTCRtpReceiver, stream: Stream,
                   keep: bool, stop_at: float) -> None:
    try:
        while time.monotonic() < stop_at:
            frame = await asyncio.wait_for(track.recv(), max(0.01, stop_at - time.monotonic()))
            stream.arrivals.append(time.monotonic())
            stream.pts.append(int(frame.pts))
            if stream.rtp_origin is None:
                stream.rtp_origin = receiver._RTCRtpReceiver__timestamp_mapper._origin  # type: ignore[attr-defined]
            if keep:
                if isinstance(frame, av.VideoFrame):
                    stream.data.append(frame.to_ndarray(format="rgb24"))
                else:
                    samples = frame.to_ndarray().reshape(-1, len(frame.layout.channels))
                    stream.data.append(samples[:, 0].copy())
    except (MediaStreamError, TimeoutError):
        pass


class PacedSpeech(MediaStreamTrack):
    """Mono 48 kHz speech (looped) in 20 ms frames on a sender clock that may run off
    true time by ``skew`` (0.01: 1% fast) and may stall: the frames due in
    ``[stall_at, stall_at + stall_s)`` all leave when the stall ends."""

    kind = "audio"

    def __init__(self, pcm: np.ndarray, *, skew: float = 0.0, stall_at: float = -1.0,
                 stall_s: float = 0.0) -> None:
        super().__init__()
        self.pcm = pcm
        self.skew = skew
        self.stall_at, self.stall_s = stall_at, stall_s
        self.n = 0
        self.start: float | None = None

    async def recv(self) -> av.AudioFrame:
        if self.start is None:
            self.start = time.monotonic()
        at = self.n * 0.02
        if self.stall_at <= at < self.stall_at + self.stall_s:
            at = self.stall_at + self.stall_s
        await asyncio.sleep(max(0.0, self.start + at / (1.0 + self.skew) - time.monotonic()))
        offset = (self.n * 960) % (self.pcm.size - 960)
        frame = av.AudioFrame.from_ndarray(self.pcm[offset:offset + 960].reshape(1, -1),
                                           format="s16", layout="mono")
        frame.sample_rate, frame.pts = 48000, self.n * 960
        frame.time_base = fractions.Fraction(1, 48000)
        self.n += 1
        return frame


@dataclass(frozen=True)
class Impairment:
    """A bad network between this client and the server, both ways: each datagram is lost
    with probability ``loss``, else held ``delay_s`` plus up to ``jitter_s``."""

    loss: float = 0.0
    delay_s: float = 0.0
    jitter_s: float = 0.0
    seed: int = 0


def impair(pc: RTCPeerConnection, impairment: Impairment) -> None:
    """Put ``impairment`` on every UDP socket ``pc`` gathered (call after
    setLocalDescription). Where netem is not available (no kernel module, no privileges)
    this is the same in user space, at the client's sockets: the server is untouched."""
    rng = np.random.default_rng(impairment.seed)
    loop = asyncio.get_running_loop()

    def held(deliver: Any, transport: asyncio.DatagramTransport) -> Any:
        def late(*args: Any) -> None:
            if not transport.is_closing():  # the socket closed while the datagram was held
                deliver(*args)

        def impaired(*args: Any) -> None:
            if rng.random() < impairment.loss:
                return
            delay = impairment.delay_s + impairment.jitter_s * rng.random()
            if delay > 0:
                loop.call_later(delay, late, *args)
            else:
                deliver(*args)
        return impaired

    for transceiver in pc.getTransceivers():
        connection = transceiver.sender.transport.transport._connection  # aioice's
        for protocol in connection._protocols:
            transport = protocol.transport
            protocol.datagram_received = held(protocol.datagram_received, transport)
            transport.sendto = held(transport.sendto, transport)


async def run_session(base_url: str, wav: str, *, seconds: float, avatar: str | None = None,
                      options: dict[str, Any] | None = None, keep: bool = True,
                      hang_up: bool = True, coefficients: bool = False,
                      audio: MediaStreamTrack | None = None,
                      network: Impairment | None = None,
                      view: tuple[str, str] | None = None,
                      configuration: RTCConfiguration | None = None,
                      count_only: bool = False, estimates: bool = True,
                      headers: dict[str, str] | None = None) -> Received:
    """Offer, stream ``wav`` in real time (or the ``audio`` track given instead), and record
    ``seconds`` of what comes back (with ``coefficients``, also the motion coefficients
    sent on a data channel). With ``options={"motion_only": True}`` the offer asks for no
    video, only coefficients; with ``network``, the datagrams cross a bad network. With
    ``view=(session_id, token)`` it sends nothing: it watches a session made by
    ``POST /sessions``, and leaves it running. ``configuration``: the client's own ICE
    servers and policy (none by default). With ``count_only`` what comes back is counted,
    not decoded (``count_frames``): its frames have a ``pts`` and nothing else. Without
    ``estimates`` the viewer tells the server no bandwidth estimates (REMB), as a player
    without congestion control would (``without_bandwidth_estimates``). ``headers`` go
    with the offer and the hang-up."""
    motion_only = bool(options and options.get("motion_only"))
    pc = RTCPeerConnection(configuration or RTCConfiguration(iceServers=[]))
    if view is not None:
        pc.addTransceiver("audio", direction="recvonly")
        hang_up = False
    else:
        if audio is None:
            audio = MediaPlayer(wav).audio
        assert audio is not None
        pc.addTrack(audio)
    if not motion_only:
        pc.addTransceiver("video", direction="recvonly")
    messages: list[dict[str, Any]] = []
    arrivals: list[float] = []
    if coefficients or motion_only:
        channel = pc.createDataChannel("coefficients")

        @channel.on("message")
        def on_message(message: str) -> None:
            messages.append(json.loads(message))
            arrivals.append(time.monotonic())
    tracks: list[tuple[MediaStreamTrack, RTCRtpReceiver]] = []

    @pc.on("track")
    def on_track(track: MediaStreamTrack) -> None:
        receiver = next(t.receiver for t in pc.getTransceivers() if t.receiver.track is track)
        tracks.append((track, receiver))

    await pc.setLocalDescription(await pc.createOffer())
    if count_only:
        count_frames(pc)
    if network is not None:
        impair(pc, network)
    sdp = pc.localDescription.sdp
    body: dict[str, Any] = {"sdp": sdp if estimates else without_bandwidth_estimates(sdp),
                            "type": "offer"}
    if view is not None:
        body["session_id"], body["token"] = view
    if avatar:
        body["avatar"] = avatar
    if options:
        body["options"] = options
    try:
        async with aiohttp.ClientSession(headers=headers) as http:
            status, answer = await post_once_ready(http, f"{base_url}/offer", body)
            if status != 200:
                raise RuntimeError(f"offer refused: {status} {answer}")
            received = Received(answer["session_id"], answer=answer, coefficients=messages,
                                coefficient_arrivals=arrivals)
            for transceiver in pc.getTransceivers():
                _watch_sender_reports(transceiver.receiver, getattr(received, transceiver.kind))
            ptime = asked_ptime(answer["sdp"])
            if isinstance(audio, EncodedSpeech) and ptime:
                audio.frames_per_packet = max(1, min(6, ptime // 20))
            await pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], answer["type"]))
            stop_at = time.monotonic() + seconds
            await asyncio.gather(*(
                _consume(track, receiver, getattr(received, track.kind), keep, stop_at)
                for track, receiver in tracks))
            if hang_up:
                async with http.delete(f"{base_url}/sessions/{received.session_id}"):
                    pass
    finally:
        await pc.close()
    return received


async def post_once_ready(http: aiohttp.ClientSession, url: str, body: dict[str, Any]
                          ) -> tuple[int, Any]:
    """POST ``body``; while the server answers 503 ``calibrating`` (for its first seconds it
    measures what a session costs), ask again as its ``Retry-After`` says, up to
    ``START_WAIT_S``. Any other answer is returned as it came."""
    give_up_at = time.monotonic() + START_WAIT_S
    while True:
        async with http.post(url, json=body) as response:
            answer = await response.json()
            if response.status != 503 or answer.get("error") != "calibrating" \
                    or time.monotonic() > give_up_at:
                return response.status, answer
            delay = float(response.headers.get("Retry-After", 5))
        await asyncio.sleep(delay)


def without_bandwidth_estimates(sdp: str) -> str:
    """An offer without the send-time header extension, which aiortc's receivers need to
    estimate bandwidth: the server then hears no REMB from this peer."""
    return "".join(line for line in sdp.splitlines(keepends=True)
                   if "abs-send-time" not in line)


class SessionClient:
    """An application's handle on a session it drives (``POST /sessions``): speak into it,
    as a whole WAV or as PCM chunks while a TTS makes them, interrupt it, follow its
    events, end it. Use as ``async with SessionClient(url) as avatar: ...``."""

    def __init__(self, base_url: str, *, api_key: str | None = None,
                 avatar: str | None = None, size: int | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._create = {k: v for k, v in (("avatar", avatar), ("size", size)) if v}
        self._http: aiohttp.ClientSession | None = None
        self.session_id = self.token = ""

    async def __aenter__(self) -> SessionClient:
        self._http = aiohttp.ClientSession(headers=self._headers)
        status, answer = await post_once_ready(self._http, self.base_url + "/sessions",
                                               self._create)
        if status != 201:
            await self._http.close()
            raise RuntimeError(f"POST /sessions: {status} {answer}")
        self.session_id, self.token = answer["session_id"], answer["token"]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._http is not None
        async with self._http.delete(self.base_url + self._path()):
            pass
        await self._http.close()

    def _path(self, suffix: str = "") -> str:
        return f"/sessions/{self.session_id}{suffix}"

    async def _call(self, method: str, path: str, status: int, **kwargs: Any) -> Any:
        assert self._http is not None, "use SessionClient in async with"
        async with self._http.request(method, self.base_url + path, **kwargs) as response:
            answer = await response.json()
            if response.status != status:
                raise RuntimeError(f"{method} {path}: {response.status} {answer}")
            return answer

    async def speak_wav(self, wav: bytes) -> dict[str, Any]:
        """Queue a WAV; answered once it has all arrived (it plays at real time)."""
        return await self._call("POST", self._path("/speech"), 200, data=wav,
                                headers={"Content-Type": "audio/wav"})

    async def speak(self, chunks: Any, rate: int) -> dict[str, Any]:
        """Stream int16 mono chunks at ``rate`` Hz (an async iterable, e.g. a TTS as it
        synthesises) as one utterance; the server reads them no faster than it plays."""
        async def body() -> Any:
            async for chunk in chunks:
                yield np.asarray(chunk, np.int16).astype(">i2").tobytes()

        return await self._call("POST", self._path("/speech"), 200, data=body(),
                                headers={"Content-Type": f"audio/L16;rate={rate};channels=1"})

    async def interrupt(self) -> dict[str, Any]:
        """Barge-in: which utterances were cut, and how much of each was heard."""
        return await self._call("POST", self._path("/interrupt"), 200)

    async def events(self, following: asyncio.Event | None = None) -> Any:
        """The session's events (dicts) until it ends; ``following`` is set once the
        stream is open, so that no event from then on can be missed."""
        assert self._http is not None
        async with self._http.get(self.base_url + self._path("/events"),
                                  timeout=aiohttp.ClientTimeout(total=None)) as response:
            if following is not None:
                following.set()
            async for line in response.content:
                if line.startswith(b"data: "):
                    yield json.loads(line[6:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("wav", nargs="?", default="",
                        help="the speech to send (not with --view)")
    parser.add_argument("--view", nargs=2, metavar=("SESSION", "TOKEN"),
                        help="send nothing: watch a session made by POST /sessions")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--avatar")
    parser.add_argument("--motion-only", action="store_true",
                        help="no video: count the coefficients sent on the data channel")
    parser.add_argument("--ice-host", action="append", default=None, metavar="ADDR",
                        help="offer only these host candidates (default 127.0.0.1 for a "
                             "loopback server URL)")
    args = parser.parse_args()
    hosts = args.ice_host
    if hosts is None and urlparse(args.url).hostname in ("127.0.0.1", "localhost"):
        hosts = ["127.0.0.1"]
    pin_host_addresses(hosts or [])
    options = {"motion_only": True} if args.motion_only else None
    if not args.view and not args.wav:
        parser.error("give a WAV to send, or --view SESSION TOKEN")
    received = asyncio.run(run_session(args.url, args.wav, seconds=args.seconds,
                                       avatar=args.avatar, options=options, keep=False,
                                       view=tuple(args.view) if args.view else None))
    print(json.dumps({"session_id": received.session_id,
                      "video_frames": len(received.video.pts),
                      "audio_frames": len(received.audio.pts),
                      "video_fps": round(received.video_fps(), 2),
                      "coefficient_messages": len(received.coefficients),
                      "motion_fps": round(received.motion_fps(), 2)}))


if __name__ == "__main__":
    main()
