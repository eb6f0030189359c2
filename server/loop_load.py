"""How busy a process's event loop is: the share of each second its thread spends on CPU.

A media worker's peers, audio and features all run on its one event-loop thread, so that
thread saturates before the host's cores do (on an H200 host, eight workers at 16
sessions of 256x256 each fell to 21.7 fps with cores to spare). The front door admits by
this measure, kept current, rather than by a session count fixed in advance.
"""

from __future__ import annotations

import asyncio
import time


class LoopLoad:
    """The loop thread's CPU share, measured every ``interval`` seconds and smoothed."""

    def __init__(self, interval: float = 1.0, smoothing: float = 0.5) -> None:
        self.interval = interval
        self.smoothing = smoothing
        self.value = 0.0

    async def run(self) -> None:
        """Measure until cancelled; call on the loop to be measured."""
        cpu, wall = time.thread_time(), time.monotonic()
        while True:
            await asyncio.sleep(self.interval)
            now_cpu, now_wall = time.thread_time(), time.monotonic()
            share = (now_cpu - cpu) / max(now_wall - wall, 1e-6)
            self.value += self.smoothing * (min(share, 1.0) - self.value)
            cpu, wall = now_cpu, now_wall
