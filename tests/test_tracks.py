"""The outbound video track on a source the test controls: it sends each frame index at
its clock time, repeats the last frame when the next is not ready, and reports frame times
it had to skip because the event loop fell behind."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from server.media_clock import MediaClock
from server.tracks import SessionVideoTrack


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
        return np.full((16, 16, 3), index, np.uint8) if index in self.ready else None

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
