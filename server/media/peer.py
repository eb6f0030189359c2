"""WebRTC peers: ICE settings, offer checks, and wiring one RTCPeerConnection to a session.

The offering peer sends the driving speech on its audio m-line and receives the avatar's
video and the delayed audio back. ICE is gathered fully before the answer (no trickle).
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import logging
import re
from collections.abc import Callable

import aioice.ice
from aiortc import (
    RTCConfiguration,
    RTCDataChannel,
    RTCIceServer,
    RTCPeerConnection,
    RTCSessionDescription,
)
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtcrtpsender import RTCRtpSender
from aiortc.rtp import RTCP_PSFB_APP, RtcpPsfbPacket, unpack_remb_fci
from aiortc.sdp import SessionDescription

from server.config import IceSettings
from server.media.audio_ingest import decode_on_loop
from server.media.session import Session
from server.media.tracks import SharedVideoTrack

log = logging.getLogger(__name__)


_ICE_UFRAG = re.compile(r"[A-Za-z0-9+/]{4,256}")
_ICE_PWD = re.compile(r"[A-Za-z0-9+/]{22,256}")
#: The certificate fingerprints aiortc can check a peer's DTLS certificate against.
DTLS_FINGERPRINTS = ("sha-256", "sha-384", "sha-512")


#: The private ranges ``ice.private_candidates = false`` refuses an offer's candidates in:
#: RFC 1918, the carrier-grade NAT's shared range, unique-local IPv6.
PRIVATE_RANGES = [ipaddress.ip_network(r) for r in
                  ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
                   "fc00::/7")]
#: Bounds on an offer, far above what a session uses (three m-lines, about 5 kB).
MAX_SDP_BYTES = 64 * 1024
MAX_MEDIA = 16


class OfferError(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def rtc_configuration(ice: IceSettings) -> RTCConfiguration:
    """ICE servers from the settings; TURN URLs carry the configured credentials."""
    def server(url: str) -> RTCIceServer:
        if url.startswith(("turn:", "turns:")):
            return RTCIceServer(urls=url, username=ice.username or None,
                                credential=ice.credential or None)
        return RTCIceServer(urls=url)

    return RTCConfiguration(iceServers=[server(url) for url in ice.servers])


def pin_host_addresses(addresses: list[str]) -> None:
    """Offer only these host candidates (aioice offers every interface but loopback).

    aioice reads the addresses through one module function, so this is process-wide:
    it is a server setting applied once at start-up.
    """
    if addresses:
        pinned = list(addresses)
        aioice.ice.get_host_addresses = lambda use_ipv4, use_ipv6: pinned  # type: ignore


def check_offer(sdp: object, kind: object, *, motion_only: bool = False,
                viewer: bool = False, publisher: bool = False) -> str:
    """The offer's SDP if it can drive a session; otherwise an ``OfferError`` naming why.
    A motion-only session needs a data channel instead of a video m-line; a ``viewer``
    sends nothing, and must receive the audio; a ``publisher`` (WHIP) only sends."""
    if kind != "offer":
        raise OfferError("not_an_offer", f'"type" must be "offer", got {repr(kind)[:64]}')
    if not isinstance(sdp, str) or not sdp.strip():
        raise OfferError("missing_sdp", '"sdp" must be a non-empty string')
    if not sdp.lstrip().startswith("v=0"):
        raise OfferError("malformed_sdp", "SDP must start with v=0")
    # Bounded before parsing: answering an offer runs on the event loop every session
    # shares, and one with 1,000 m-lines (1.45 MB) held it for seconds.
    if len(sdp) > MAX_SDP_BYTES:
        raise OfferError("sdp_too_large", f"SDP of {len(sdp)} characters; at most "
                         f"{MAX_SDP_BYTES}")
    media = sdp.count("\nm=")
    if media > MAX_MEDIA:
        raise OfferError("too_many_m_lines", f"SDP with {media} m-lines; a session needs "
                         f"audio, video and a data channel, and at most {MAX_MEDIA} are read")
    try:
        parsed = SessionDescription.parse(sdp)
    except Exception as exc:  # aiortc raises assorted errors on malformed SDP
        raise OfferError("malformed_sdp", f"SDP could not be parsed: {exc}") from None
    audio = [m for m in parsed.media if m.kind == "audio" and m.port != 0]
    video = [m for m in parsed.media if m.kind == "video" and m.port != 0]
    if viewer:
        if not any(m.direction in ("sendrecv", "recvonly") for m in audio):
            raise OfferError("no_audio", "a viewer's offer must ask to receive audio")
    elif not any(m.direction in ("sendrecv", "sendonly") for m in audio):
        raise OfferError("no_audio", "the offer must send one audio track (the driving speech)")
    if motion_only:
        if not any(m.kind == "application" and m.port != 0 for m in parsed.media):
            raise OfferError("no_data_channel", "a motion-only session sends its coefficients "
                             'on a data channel: the offer must open one ("coefficients")')
    elif not publisher and not any(m.direction in ("sendrecv", "recvonly") for m in video):
        raise OfferError("no_video", "the offer must ask to receive video")
    for m in audio + video:
        if m.ice is None or not m.ice.usernameFragment or not m.dtls or not m.dtls.fingerprints:
            raise OfferError("malformed_sdp", f"{m.kind} m-line lacks ICE credentials or a "
                             "DTLS fingerprint")
        # What would only fail later, after a session was made (RFC 8839 ice-char, 4-256
        # characters of ufrag, 22-256 of password; aiortc checks sha-256/384/512).
        if not _ICE_UFRAG.fullmatch(m.ice.usernameFragment) or \
                not _ICE_PWD.fullmatch(m.ice.password or ""):
            raise OfferError("bad_ice_credentials", f"{m.kind} m-line: the ICE ufrag must be "
                             "4-256 and the password 22-256 characters of [A-Za-z0-9+/]")
        if not any(f.algorithm.lower() in DTLS_FINGERPRINTS for f in m.dtls.fingerprints):
            raise OfferError("bad_fingerprint", f"{m.kind} m-line: no DTLS fingerprint in "
                             f"{', '.join(DTLS_FINGERPRINTS)}")
    return sdp


def allowed_candidates(sdp: str, ice: IceSettings) -> tuple[str, int]:
    """The offer without the candidates the server must not contact, and how many went.

    A candidate names an address the server will send STUN to: an offer could point it at
    a cloud metadata service, a link-local or multicast address, or a host name to resolve
    by DNS. Those in ``ice.blocked_ranges`` are dropped, and so are names, except
    ``.local`` (mDNS) ones where ``ice.mdns`` allows. A peer left with no candidate still
    connects: its own checks reach the server, which answers where they came from.
    An IPv4 address written as IPv6 (``::ffff:a.b.c.d``) is judged as the IPv4 it is;
    without ``ice.private_candidates`` private ranges are refused too."""
    blocked = [ipaddress.ip_network(r, strict=False) for r in ice.blocked_ranges]
    if not ice.private_candidates:
        blocked += PRIVATE_RANGES

    def allowed(address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address.split("%")[0])
        except ValueError:
            return ice.mdns and address.lower().endswith(".local")
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # ::ffff:169.254.169.254 is 169.254.169.254
        return not any(ip.version == net.version and ip in net for net in blocked)

    kept, dropped = [], 0
    for line in sdp.splitlines(keepends=True):
        fields = line.split()
        if line.startswith("a=candidate:") and (len(fields) < 6 or not allowed(fields[4])):
            dropped += 1
            continue
        kept.append(line)
    return "".join(kept), dropped


async def _drain(track: MediaStreamTrack) -> None:
    try:
        while True:
            await track.recv()
    except MediaStreamError:
        pass


def _hear_reports(sender: RTCRtpSender, session: Session) -> None:
    """Tell ``session`` whenever the peer reports on what it receives (RTCP, about once a
    second from browsers and aiortc alike): a peer whose microphone is quiet still does.
    aiortc has no event for it, so this wraps the sender's RTCP handler."""
    handle = sender._handle_rtcp_packet
    loop = asyncio.get_running_loop()

    async def heard(packet: object) -> None:
        session.heard_from_peer(loop.time())
        await handle(packet)

    sender._handle_rtcp_packet = heard  # type: ignore[method-assign]


def _share_feedback(sender: RTCRtpSender, video: SharedVideoTrack) -> None:
    """What a viewer reports about its video goes to the encoding it shares: a lost
    picture (PLI, FIR) asks a key frame of it, and a bandwidth estimate (REMB) bounds its
    rate. aiortc would hand both to the sender's own encoder, which encodes nothing here."""
    sender._send_keyframe = video.request_keyframe  # type: ignore[method-assign]
    handle = sender._handle_rtcp_packet

    async def handled(packet: object) -> None:
        if isinstance(packet, RtcpPsfbPacket) and packet.fmt == RTCP_PSFB_APP:
            try:
                bitrate, ssrcs = unpack_remb_fci(packet.fci)
            except ValueError:
                pass
            else:
                if sender._ssrc in ssrcs:
                    video.limit_bitrate(bitrate)
        await handle(packet)

    sender._handle_rtcp_packet = handled  # type: ignore[method-assign]


def _prefer_codec(pc: RTCPeerConnection, codec: str, *, only: bool = False) -> None:
    """``codec`` first in the answer; with ``only``, no other (retransmissions aside)."""
    wanted = f"video/{codec.upper()}"
    capabilities = RTCRtpSender.getCapabilities("video").codecs
    preferred = [c for c in capabilities if c.mimeType.upper() == wanted.upper()]
    if not preferred:
        return
    rest = [c for c in capabilities if c not in preferred and
            (not only or c.mimeType.lower() == "video/rtx")]
    for transceiver in pc.getTransceivers():
        if transceiver.kind == "video":
            transceiver.setCodecPreferences(preferred + rest)


def send_session(pc: RTCPeerConnection, session: Session, codec: str
                 ) -> list[MediaStreamTrack]:
    """Add a fresh pair of ``session``'s outbound tracks to ``pc`` (audio alone for a
    motion-only one), wired so the receiver's reports reach the session and its shared
    encoding. VP8 is encoded once per session for every viewer, so VP8 alone is offered
    or answered. The tracks, to stop when this peer goes (the session may have others)."""
    shared = codec.upper() == "VP8" and not session.motion_only
    audio_out, video_out = session.viewer_tracks(shared=shared)
    senders = [pc.addTrack(audio_out)]
    if not session.motion_only:
        senders.append(pc.addTrack(video_out))
        if isinstance(video_out, SharedVideoTrack):
            _share_feedback(senders[-1], video_out)
    for sender in senders:
        _hear_reports(sender, session)
    _prefer_codec(pc, codec, only=shared)
    return [audio_out, video_out]


def with_ptime(sdp: str, ms: int) -> str:
    """``sdp`` with ``a=ptime:ms`` in each audio section (RFC 4566 6): the length of audio
    this end wants in a packet. Browsers then send that much speech a packet (Chromium
    does), so 40 ms halves the packets a session's worker takes in, and their work."""
    return re.sub(r"(m=audio [^\r\n]*\r?\n)", rf"\g<1>a=ptime:{ms}\r\n", sdp)


class PeerRole(enum.Enum):
    """What a peer is to its session."""

    PEER = "peer"  # the offering peer: its audio drives the session, it gets the avatar back
    PUBLISHER = "publisher"  # a WHIP publisher: its audio drives the session, it gets nothing
    VIEWER = "viewer"  # it watches: it gets the avatar, and what it may send is not heard

    @property
    def drives(self) -> bool:
        return self is not PeerRole.VIEWER


async def answer_offer(session: Session, sdp: str, *, ice: IceSettings, codec: str,
                       on_gone: Callable[[str], object], role: PeerRole,
                       audio_packet_ms: int) -> tuple[RTCPeerConnection, str]:
    """Answer an offer for ``session``: the audio of a peer that drives it feeds the
    session, and its connection's state is the session's; every receiver but a
    publisher's gets a fresh pair of viewer tracks. ``on_gone(reason)`` is called when the
    peer leaves. Returns the connection and the answer, which asks for
    ``audio_packet_ms`` of audio a packet (``with_ptime``)."""
    pc = RTCPeerConnection(rtc_configuration(ice))

    @pc.on("track")
    def on_track(track: MediaStreamTrack) -> None:
        if track.kind == "audio" and role.drives:
            decode_on_loop(pc, track)
            session.add_audio_track(track)
        else:  # a publisher's camera, a viewer's microphone: read and dropped, or aiortc
            asyncio.get_running_loop().create_task(_drain(track))  # would queue it all

    @pc.on("datachannel")
    def on_datachannel(channel: RTCDataChannel) -> None:
        if channel.label == "coefficients":
            session.add_coefficient_channel(channel)
        elif channel.label == "events":
            session.events.add_channel(channel)

    tracks: list[MediaStreamTrack] = []

    @pc.on("connectionstatechange")
    async def on_state() -> None:
        state = pc.connectionState
        if role.drives:
            session.peer_state(state)
        if state in ("failed", "closed"):
            for track in tracks:  # this peer's; the session may have others
                track.stop()
            on_gone(f"peer connection {state}")

    sdp, dropped = allowed_candidates(sdp, ice)
    if dropped:
        log.info("session %s: %d remote candidate(s) refused by the candidate policy",
                 session.id, dropped)
    try:
        await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
        if role is PeerRole.PUBLISHER:  # its audio only: a camera it offers is declined
            for transceiver in pc.getTransceivers():
                if transceiver.kind != "audio":
                    transceiver.direction = "inactive"
            await pc.setLocalDescription(await pc.createAnswer())
        else:
            tracks += send_session(pc, session, codec)
            await pc.setLocalDescription(await pc.createAnswer())
    except Exception:
        await pc.close()
        raise
    return pc, with_ptime(pc.localDescription.sdp, audio_packet_ms)
