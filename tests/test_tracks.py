"""The outbound tracks on a source the test controls: video sends each frame index at its
clock time, repeats the last frame when the next is not ready, and reports frame times it
had to skip because the event loop fell behind; audio sends its chunks joined in packets
on the same clock."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import av
import numpy as np
import pytest

from server.media.clock import MediaClock
from server.media.encoding import EncodeBatches, Vp8Tuning
from server.media.tracks import SessionVideoTrack

pytestmark = pytest.mark.unit


class Source:
    def __init__(self) -> None:
        self.clock = MediaClock(origin=asyncio.get_running_loop().time() + 0.05, fps=25,
                                delay=0.0)
        self.ready: set[int] = set()
        self.sent: list[tuple[int, int]] = []  # (index, content index)
        self.skipped = 0

    @property
    def is_closed(self) -> bool:
        return False

    def video_frame(self, index: int) -> np.ndarray | None:
        """A 16x16 frame in I420, as engines make them for the server."""
        return np.full((24, 16), index, np.uint8) if index in self.ready else None

    def idle_frame(self) -> np.ndarray:
        return np.zeros((16, 16, 3), np.uint8)

    def report_video(self, index: int, content_index: int, sent_at: float) -> None:
        self.sent.append((index, content_index))

    def report_skipped(self, count: int) -> None:
        self.skipped += count


async def test_video_track_repeats_a_late_frame_and_reports_skipped_frame_times() -> None:
    source = Source()
    source.ready = {0, 2}
    track = SessionVideoTrack(source)
    for _ in range(3):
        await track.recv()
    assert source.sent == [(0, 0), (1, 0), (2, 2)] and source.skipped == 0
    time.sleep(0.2)  # the loop is blocked for five frame times
    frame = await track.recv()
    index = source.sent[-1][0]
    assert index >= 7 and source.skipped == index - 3
    assert frame.pts == source.clock.video_pts(index)


async def test_a_frame_time_the_loop_comes_to_late_still_leaves_and_is_not_skipped() -> None:
    source = Source()
    source.ready = set(range(10))
    track = SessionVideoTrack(source)
    for _ in range(2):
        await track.recv()
    time.sleep(0.055)  # past frame 2's time, not frame 3's
    await track.recv()
    await track.recv()
    assert source.sent == [(0, 0), (1, 1), (2, 2), (3, 3)] and source.skipped == 0


async def test_an_audio_chunk_the_loop_comes_to_late_still_leaves() -> None:
    from server.media.tracks import SessionAudioTrack

    class Audio:
        clock = Source().clock
        is_closed = False
        reported: list[int] = []

        def audio_chunk(self, k: int) -> np.ndarray:
            return np.full(960, k, np.int16)

        def report_audio(self, k: int, sent_at: float) -> None:
            self.reported.append(k)

    source = Audio()
    track = SessionAudioTrack(source)  # type: ignore[arg-type]
    await track.recv()
    time.sleep(0.03)  # past chunk 1's time, not chunk 2's
    for _ in range(3):
        await track.recv()
    time.sleep(0.05)  # past chunks 4 and 5: 4 is skipped, 5 leaves late
    await track.recv()
    assert source.reported == [0, 1, 2, 3, 5]


async def test_audio_chunks_leave_joined_in_packets_of_the_clock_and_a_late_packet_is_skipped():
    from server.media.tracks import SessionAudioTrack

    class Audio:
        clock = replace(Source().clock, packet_chunks=2)
        is_closed = False
        reported: list[tuple[int, float]] = []

        def audio_chunk(self, k: int) -> np.ndarray:
            t = (960 * k + np.arange(960)) / 48000
            return (8000 * np.sin(2 * np.pi * 300 * t)).astype(np.int16)

        def report_audio(self, k: int, sent_at: float) -> None:
            self.reported.append((k, sent_at))

    source = Audio()
    track = SessionAudioTrack(source)  # type: ignore[arg-type]
    decoder = av.CodecContext.create("libopus", "r")
    packets = [await track.recv() for _ in range(2)]
    time.sleep(0.09)  # past packet 3's time (chunks 6 and 7), not packet 4's
    packets.append(await track.recv())
    assert [p.pts for p in packets] == [0, 1920, 5760]  # packet 2 skipped, not sent late
    assert all(sum(f.samples for f in decoder.decode(p)) == 1920 for p in packets)
    assert [k for k, _ in source.reported] == [0, 1, 2, 3, 6, 7]
    sent = dict(source.reported)
    assert sent[1] == sent[0] and sent[3] - sent[0] >= 0.04 - 0.002


async def test_audio_chunks_that_cannot_be_joined_leave_one_by_one_in_their_order(
        monkeypatch) -> None:
    import server.media.tracks
    from server.media.tracks import SessionAudioTrack

    class Audio:
        clock = replace(Source().clock, packet_chunks=2)
        is_closed = False

        def audio_chunk(self, k: int) -> np.ndarray:
            return np.full(960, 100 * k, np.int16)

        def report_audio(self, k: int, sent_at: float) -> None:
            pass

    monkeypatch.setattr(server.media.tracks, "join_opus", lambda packets: None)  # modes differ
    track = SessionAudioTrack(Audio())  # type: ignore[arg-type]
    packets = [await track.recv() for _ in range(4)]
    assert [p.pts for p in packets] == [0, 960, 1920, 2880]


def test_clocks_started_on_one_phase_of_the_grid_share_their_instants() -> None:
    from server.media.clock import on_grid

    period = 1 / 25
    for now in (1000.0, 1000.013, 1000.0399, 123456.789):
        origins = [on_grid(now + lag, 25, phase, 2) for lag in (0.0, 0.011)
                   for phase in (0, 1)]
        for origin, lag in zip(origins, (0.0, 0.0, 0.011, 0.011), strict=True):
            assert now + lag <= origin < now + lag + period + 1e-9
        for phase in (0, 1):  # whenever in a period a session starts, on its phase's instant
            offset = (origins[phase] - phase * period / 2) / period
            assert abs(offset - round(offset)) < 1e-6
        assert abs(abs(origins[1] - origins[0]) - period / 2) < 1e-6


def test_an_i420_picture_becomes_the_same_video_frame_with_or_without_row_padding() -> None:
    import av

    from server.media.tracks import i420_frame

    rng = np.random.default_rng(0)
    for side in (256, 512, 200):  # 200: PyAV pads its rows
        yuv = rng.integers(0, 256, (side * 3 // 2, side), np.uint8)
        frame = i420_frame(yuv)
        assert (frame.width, frame.height, frame.format.name) == (side, side, "yuv420p")
        np.testing.assert_array_equal(
            frame.to_ndarray(), av.VideoFrame.from_ndarray(yuv, format="yuv420p").to_ndarray())


class LateSource(Source):
    """Frame ``i`` is rendered ``late[i]`` seconds after its send time (never if absent)."""

    def __init__(self, grace: float, late: dict[int, float]) -> None:
        super().__init__()
        self.clock = MediaClock(origin=self.clock.origin, fps=25, delay=0.0, grace=grace)
        loop = asyncio.get_running_loop()
        self.frames: dict[int, asyncio.Future[None]] = {}
        for index, seconds in late.items():
            future = loop.create_future()
            loop.call_at(self.clock.video_send_time(index) + seconds, future.set_result, None)
            self.frames[index] = future
        self.sent_at: list[float] = []

    def video_frame(self, index: int) -> np.ndarray | None:
        future = self.frames.get(index)
        return np.full((24, 16), index, np.uint8) if future is not None and future.done() \
            else None

    async def wait_video_frame(self, index: int, until: float) -> np.ndarray | None:
        future = self.frames.get(index)
        if future is not None:
            try:
                await asyncio.wait_for(asyncio.shield(future),
                                       until - asyncio.get_running_loop().time())
            except TimeoutError:
                pass
        return self.video_frame(index)

    def report_video(self, index: int, content_index: int, sent_at: float) -> None:
        super().report_video(index, content_index, sent_at)
        self.sent_at.append(sent_at - self.clock.video_send_time(index))


async def test_a_frame_late_by_less_than_the_grace_leaves_late_and_a_later_one_is_repeated():
    source = LateSource(grace=0.015, late={0: -0.01, 1: 0.006, 2: 0.03, 3: -0.01})
    track = SessionVideoTrack(source)
    for _ in range(4):
        await track.recv()
    # Frame 1 waited for (6 ms late, within the 15 ms grace); frame 2 (30 ms) was not:
    # frame 1 again, sent once the grace ran out; frame 3 on time.
    assert source.sent == [(0, 0), (1, 1), (2, 1), (3, 3)]
    assert 0.004 <= source.sent_at[1] <= 0.012 and 0.013 <= source.sent_at[2] <= 0.025
    assert source.sent_at[0] < 0.004 and source.sent_at[3] < 0.004


async def test_a_viewer_whose_transport_comes_up_late_starts_at_a_fresh_key_frame() -> None:
    """Frames paced while the viewer's handshake runs are not queued for it: they would
    reach it in a burst, as old as the handshake took."""
    from server.media.tracks import SharedVideo, SharedVideoTrack

    source = Source()
    source.ready = set(range(100))
    video = SharedVideo(source, EncodeBatches(), Vp8Tuning())
    track = SharedVideoTrack(video)
    await asyncio.sleep(0.3)  # the handshake: seven frame times paced meanwhile
    reading_from = source.clock.video_index_due(asyncio.get_running_loop().time())
    first = await asyncio.wait_for(track.recv(), 0.2)
    second = await track.recv()
    video.close()
    assert first.pts > source.clock.video_pts(reading_from)
    assert not bytes(first)[0] & 0x01  # VP8: a key frame
    assert second.pts - first.pts == source.clock.video_pts(1) - source.clock.video_pts(0)


async def test_a_viewer_that_could_take_more_is_sent_no_more_than_the_cap() -> None:
    """``video.max_bitrate_kbps``: a rendered face looks no better above it; a viewer
    that can take less still gets less."""
    from server.media.tracks import SharedVideo, SharedVideoTrack

    source = Source()
    source.ready = set(range(100))
    video = SharedVideo(source, EncodeBatches(), Vp8Tuning(), max_bitrate=600_000)
    track = SharedVideoTrack(video)
    await asyncio.wait_for(track.recv(), 0.5)
    track.limit_bitrate(1_400_000)
    capped = video.bitrate
    track.limit_bitrate(300_000)
    video.close()
    assert capped == 600_000 and video.bitrate == 300_000


async def test_when_the_poorest_viewer_leaves_the_rate_rises_once_the_hold_ends() -> None:
    """A rise waits out the hold since the last change, and is then taken even if no
    viewer reports again: the one that held everyone back is gone."""
    from server.media.tracks import SharedVideo, SharedVideoTrack

    source = Source()
    source.ready = set(range(100))
    video = SharedVideo(source, EncodeBatches(), Vp8Tuning(), retarget_every_s=0.3)
    rich, poor = SharedVideoTrack(video), SharedVideoTrack(video)
    await asyncio.wait_for(asyncio.gather(rich.recv(), poor.recv()), 0.5)
    rich.limit_bitrate(1_000_000)
    poor.limit_bitrate(300_000)
    poor.stop()
    held = video.bitrate
    await asyncio.sleep(0.5)
    risen = video.bitrate
    video.close()
    assert held == 300_000 and risen == 1_000_000

