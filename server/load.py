"""How busy the server is, measured each second: a worker's event loop, and the cores.

A media worker's peers, audio and features all run on its one event-loop thread, so that
thread can saturate before the host's cores do (on an H200 host, eight workers at 16
sessions of 256x256 each fell to 21.7 fps with cores to spare); with enough workers, the
cores saturate instead (176 sessions of 256x256 took 14.7 of 16). The front door admits
by both measures, kept current, rather than by a session count fixed in advance.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: A session this old is connected and streaming, and a second's measure has seen it.
SETTLED_S = 3.0


class LoopLoad:
    """The loop thread's CPU share, measured every ``interval`` seconds and smoothed, and
    what its sessions cost it (``model``, starting from ``prior`` per 256x256 session)."""

    def __init__(self, prior: float, interval: float = 1.0, smoothing: float = 0.5) -> None:
        self.interval = interval
        self.smoothing = smoothing
        self.value = 0.0
        self.model = CostModel(prior, min_cost=2.0, reading_smoothing=smoothing)

    async def run(self, costs: Callable[[], tuple[float, float]]) -> None:
        """Measure until cancelled; call on the loop to be measured. ``costs()``: the media
        cost of its sessions, and of those settled (``CostModel.observe``)."""
        cpu, wall = time.thread_time(), time.monotonic()
        while True:
            await asyncio.sleep(self.interval)
            now_cpu, now_wall = time.thread_time(), time.monotonic()
            share = (now_cpu - cpu) / max(now_wall - wall, 1e-6)
            self.value += self.smoothing * (min(share, 1.0) - self.value)
            self.model.observe(self.value, *costs())
            cpu, wall = now_cpu, now_wall


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds a process (all its threads) has used; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


async def cores_used(pids: Callable[[], Iterable[int]], seconds: float) -> float:
    """Cores the processes ``pids()`` keep busy, together, over the next ``seconds``. A
    process started meanwhile is not counted: its start-up (loading, warming up) is not
    load that sessions put there."""
    def used() -> dict[int, float]:
        return {pid: process_cpu_seconds(pid) for pid in pids()}

    before, wall = used(), time.monotonic()
    await asyncio.sleep(seconds)
    after = used()
    spent = sum(after[p] - before[p] for p in after if p in before)
    return max(spent, 0.0) / (time.monotonic() - wall)


class CoresBusy:
    """Cores the server's processes kept busy, measured every ``interval`` seconds over
    ``pids()`` (the front door, its workers and inference processes) and smoothed."""

    def __init__(self, pids: Callable[[], Iterable[int]], interval: float = 1.0,
                 smoothing: float = 0.5) -> None:
        self.pids = pids
        self.interval = interval
        self.smoothing = smoothing
        self.value = 0.0

    async def run(self) -> None:
        while True:
            used = await cores_used(self.pids, self.interval)
            self.value += self.smoothing * (used - self.value)


class CostModel:
    """What sessions cost a resource (the server's cores, a worker's event loop): what is
    busy with none (``idle``) and per unit of media cost (``unit``, a 256x256 video
    session), learnt from what is measured whenever every session is settled, starting
    from a prior. Only then does a reading hold all of its sessions' load and nothing
    else: one taken as sessions start, or just after some ended (a smoothed reading
    lags), would charge the sessions there for work that is not theirs."""

    def __init__(self, prior: float, smoothing: float = 0.3, min_cost: float = 4.0,
                 reading_smoothing: float = 0.5) -> None:
        self.unit = prior
        self.idle = 0.0
        self.smoothing = smoothing
        self.min_cost = min_cost
        #: The readings' own smoothing (``CoresBusy``, ``LoopLoad``): what of the sessions
        #: that left a reading still holds decays by this share each reading.
        self.reading_smoothing = reading_smoothing
        self._gone = 0.0  # cost of the sessions that left, as the readings still hold it
        self._total = 0.0

    def observe(self, busy: float, total_cost: float, settled_cost: float) -> None:
        """One reading: ``busy`` with sessions of ``total_cost``, of which ``settled_cost``
        have run long enough for ``busy`` to hold them in full. A reading still holding
        more than 5% of that in sessions gone is not learnt from: on the H200 host 86
        sessions leaving within a second raised the learnt cost from 0.090 to 0.097
        cores (and one run then refused the next burst after 10 sessions)."""
        self._gone = (1 - self.reading_smoothing) * self._gone + \
            max(self._total - total_cost, 0.0)
        self._total = total_cost
        if self._gone > 0.05 * max(total_cost, self.min_cost):
            return
        if total_cost == 0:
            self.idle += self.smoothing * (busy - self.idle)
        elif settled_cost >= max(self.min_cost, total_cost):
            measured = max(0.01, (busy - self.idle) / settled_cost)
            self.unit += self.smoothing * (measured - self.unit)

    def calibrate(self, idle: float, unit: float) -> None:
        """Start from what was measured at start-up rather than the prior."""
        self.idle, self.unit = idle, unit
