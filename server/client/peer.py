"""A reference aiortc peer: sends speech as the driving audio, records what comes back.

Tests and benchmarks use it, and so can a bot. Besides the media it records the
sender reports (RTCP SR) of both returned streams, which map each stream's RTP time to
the server's wall clock: exactly what a browser uses to play lips and sound together.
So ``sender_time`` tells when the server meant each frame and each audio chunk to play.
``python -m server.client`` runs it from the command line.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import aiohttp
import av
import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.contrib.media import MediaPlayer
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtcrtpreceiver import RTCRtpReceiver
from aiortc.rtp import RTCP_PSFB_APP, RtcpPsfbPacket, RtcpSrPacket, RtpPacket, pack_remb_fci

from server.client.http import post_once_ready
from server.client.impairment import Impairment, impair
from server.client.speech import EncodedSpeech

RATES = {"audio": 48000, "video": 90000}
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


def without_bandwidth_estimates(sdp: str) -> str:
    """An offer without the send-time header extension, which aiortc's receivers need to
    estimate bandwidth: the server then hears no REMB from this peer."""
    return "".join(line for line in sdp.splitlines(keepends=True)
                   if "abs-send-time" not in line)


