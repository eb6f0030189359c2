"""Sessions and their manager in this process, with a fake inference in place of the
scheduler and engine (which answers every frame at once): what a session does with its
audio source, its viewers and its life, on real time and real speech."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from inference.engine import FrameInput, Manifest, PreparedPortrait
from inference.pixels import I420, frame_shape
from inference.scheduler import FrameResult
from server.config import load_settings
from server.media.audio_sources import PeerAudio, PushedSpeech
from server.media.avatars import AvatarStore
from server.media.clock import AUDIO_RATE
from server.media.session import Session
from server.media.sessions import AtCapacity, NameTaken, SessionManager
from server.metrics import Metrics
from server.session_spec import NewSession, SessionKind

pytestmark = pytest.mark.unit


@dataclass
class Submitted:
    frame: FrameInput
    deadline: float
    picture: bool


class FakeInference:
    """The media side's view of inference (``inference.service.Inference``), answering
    each frame at once with a blank picture of its portrait's size."""

    max_batch = 8

    def __init__(self, manifest: Manifest, capacity: float = 2500.0) -> None:
        self.manifest = manifest
        self.capacity = capacity
        self.sizes: dict[int, int] = {}
        self.released: list[int] = []
        self.submitted: list[Submitted] = []

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def prepare(self, portrait: PreparedPortrait) -> int:
        slot = len(self.sizes)
        self.sizes[slot] = portrait.size
        return slot

    def release(self, slot: int) -> None:
        self.released.append(slot)

    def frame_size(self, slot: int) -> int:
        return self.sizes[slot]

    def submit(self, frame: FrameInput, deadline: float, *, picture: bool = True
               ) -> asyncio.Future[FrameResult | None]:
        self.submitted.append(Submitted(frame, deadline, picture))
        future: asyncio.Future[FrameResult | None] = asyncio.get_running_loop().create_future()
        side = self.sizes[frame.slot] if picture else 0
        future.set_result(FrameResult(np.zeros(frame_shape(I420, side), np.uint8),
                                      np.zeros(len(self.manifest.coefficient_names),
                                               np.float32)))
        return future

    async def warm_up(self, batch: list[FrameInput], *, picture: bool = True) -> None:
        pass

    def capacity_fps(self, frame_size: int) -> float:
        return self.capacity


TIMEOUTS = {"session.connect_timeout_s": 0.3, "session.peer_timeout_s": 0.4,
            "session.unattended_timeout_s": 1.0, "session.grid_phases": 2,
            "session.max_sessions": 3}


async def _manager(**overrides: Any) -> tuple[SessionManager, FakeInference]:
    settings = load_settings(overrides={**TIMEOUTS, **overrides})
    manifest = Manifest.load(settings.manifest_path)
    inference = FakeInference(manifest)
    avatars = AvatarStore(inference, settings.avatar, settings.video.allowed_sizes)
    await avatars.load_default()
    return SessionManager(settings, manifest, inference, avatars, Metrics(), "w0-",
                          runtime="torch-cuda"), inference


def _spec(kind: SessionKind, **fields: Any) -> NewSession:
    return NewSession(kind, None, 256, {}, **fields)


async def _closed(session: Session, timeout: float = 3.0) -> str | None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not session.is_closed:
        assert asyncio.get_running_loop().time() < deadline, "the session lived on"
        await asyncio.sleep(0.02)
    return session.close_reason


async def test_pushed_speech_plays_in_order_and_announces_its_start_and_end_when_sent():
    sessions, _ = await _manager()
    session = await sessions.create(_spec(SessionKind.HOSTED), owner=None)
    try:
        speech = session.pushed
        assert isinstance(speech, PushedSpeech) and session.state == "ready"
        events = session.events.subscribe()
        tone = (3000 * np.sin(np.arange(AUDIO_RATE // 2) / 7)).astype(np.int16)  # 0.5 s
        utterance = speech.utterances.next_id()
        assert await speech.utterances.queue.put(tone, utterance, 0)
        speech.utterances.complete(utterance, tone.size)
        started = await asyncio.wait_for(events.get(), 2)
        ended = await asyncio.wait_for(events.get(), 2)
        assert (started["type"], ended["type"]) == ("utterance_started", "utterance_ended")
        assert started["utterance_id"] == ended["utterance_id"] == utterance
        # Its sound left half a second after it started, on the session's clock.
        assert ended["media_time_s"] - started["media_time_s"] == pytest.approx(0.5, abs=0.02)
        assert session.describe()["stats"]["audio"]["received_s"] == pytest.approx(0.5, abs=0.02)
    finally:
        await session.close("test over")


async def test_nobody_watching_a_hosted_session_costs_no_frames_and_a_viewer_gets_them_on_time():
    sessions, inference = await _manager()
    session = await sessions.create(_spec(SessionKind.HOSTED))
    try:
        await asyncio.sleep(0.3)
        assert inference.submitted == []  # the timeline runs, the engine is not asked
        _, video = session.viewer_tracks(shared=False)
        frames = [await video.recv() for _ in range(8)]
        assert [f.width for f in frames] == [256] * 8
        assert inference.submitted, "a watched session asks the engine for its frames"
        for request in inference.submitted:
            index = round(request.frame.clock[0] * session.clock.fps)
            assert request.deadline == pytest.approx(session.clock.frame_deadline(index))
        assert session.frames_sent >= 8
        video.stop()
    finally:
        await session.close("test over")


async def test_a_barge_in_drops_queued_speech_and_says_how_much_was_heard_in_its_own_units():
    sessions, _ = await _manager()
    session = await sessions.create(_spec(SessionKind.HOSTED))
    try:
        speech = session.pushed
        assert speech is not None
        utterance = speech.utterances.next_id()
        speech.utterances.sent_at(utterance, 16000)  # as its upload was: in its own samples
        long = np.full(4 * AUDIO_RATE, 2000, np.int16)
        put = asyncio.create_task(speech.utterances.queue.put(long, utterance, 0))
        await asyncio.sleep(0.6)
        cut = session.interrupt()
        (heard,) = cut["interrupted"]
        assert heard["utterance_id"] == utterance
        assert 0 < heard["heard_s"] < 4 and heard["rate"] == 16000
        assert heard["heard_samples"] == pytest.approx(heard["heard_s"] * 16000, abs=16)
        assert speech.utterances.queue.queued == 0
        assert await put  # everything it gave was taken: it had all been queued
    finally:
        await session.close("test over")


async def test_a_peer_that_never_connects_frees_its_place():
    sessions, inference = await _manager()
    session = await sessions.create(_spec(SessionKind.PEER))
    assert isinstance(session.audio, PeerAudio) and session.token is None
    assert await _closed(session) == "never connected"
    assert sessions.get(session.id) is None and inference.released  # its avatar let go


async def test_a_quiet_peer_that_still_reports_stays_and_one_that_vanishes_goes():
    sessions, _ = await _manager()
    quiet = await sessions.create(_spec(SessionKind.PUBLISHER))
    vanished = await sessions.create(_spec(SessionKind.PUBLISHER))
    for session in (quiet, vanished):
        session.peer_state("connected")
        assert session.state == "connected" and session.token
    loop = asyncio.get_running_loop()
    for _ in range(10):  # 1 s: RTCP reports from the quiet one only
        quiet.heard_from_peer(loop.time())
        await asyncio.sleep(0.1)
    assert await _closed(vanished, 0.1) == "peer timeout: nothing received"
    assert not quiet.is_closed
    await quiet.close("test over")
    assert quiet.state == "closed"


async def test_a_hosted_session_nobody_uses_ends_and_one_with_speech_queued_stays():
    sessions, _ = await _manager()
    idle = await sessions.create(_spec(SessionKind.HOSTED))
    assert await _closed(idle) == "idle: no speech and no viewer"
    with pytest.raises(TypeError):  # its speech is pushed, not a peer's
        idle.add_audio_track(None)  # type: ignore[arg-type]


async def test_the_manager_holds_its_limits_and_names_and_spreads_clocks_over_the_grid():
    sessions, inference = await _manager()
    made = [await sessions.create(_spec(SessionKind.HOSTED, name=f"s{i}")) for i in range(2)]
    try:
        with pytest.raises(NameTaken):
            await sessions.create(_spec(SessionKind.HOSTED, name="s0"))
        assert sorted(s.grid_phase for s in made) == [(0, 2), (1, 2)]
        made.append(await sessions.create(_spec(SessionKind.HOSTED)))
        with pytest.raises(AtCapacity, match="maximum of 3 sessions"):
            await sessions.create(_spec(SessionKind.HOSTED))
        assert sessions.named("s1") is made[1] and len(sessions) == 3
        await made.pop(0).close("hung up")
        assert sessions.named("s0") is None and len(sessions) == 2
    finally:
        await sessions.close_all()
    assert len(sessions) == 0


async def test_the_engine_load_refuses_what_the_engine_could_not_render_in_time():
    sessions, inference = await _manager(**{"session.max_engine_load": 0.9})
    inference.capacity = 50.0  # frames/s: one 25 fps session takes half, two would pass 0.9
    first = await sessions.create(_spec(SessionKind.HOSTED))
    try:
        with pytest.raises(AtCapacity, match="session.max_engine_load"):
            await sessions.create(_spec(SessionKind.HOSTED))
    finally:
        await first.close("test over")
