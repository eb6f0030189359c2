"""The shared scheduler and the engine in a process of their own, fed through shared memory.

One Python process cannot carry a GPU's worth of sessions: the engine's Python side
(packing inputs, launching, waiting for copies) queues for the GIL behind the media side's
event loop. Measured on an H200, a batch of one took 1.82 ms instead of 0.33 with 256
sessions' submissions on the same loop (BENCHMARKS.md). Here a child process owns the
scheduler and the engine. The media side writes a frame's inputs into a slot of a
shared-memory ring and sends the slot's number down a pipe; the child answers with that
number once the frame (uint8) and its coefficients are in the same slot. Only slot
numbers, deadlines and short replies cross the pipe; a portrait crosses it once.

Deadlines are event-loop times, which both processes read from the same monotonic clock.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import logging
import multiprocessing
import shutil
import signal
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from inference.engine import FrameInput, Manifest, PreparedPortrait
from inference.scheduler import FrameResult

log = logging.getLogger(__name__)

_ALIGN = 64


@dataclass(frozen=True)
class RingLayout:
    """Where each slot's inputs and outputs lie in the shared ring."""

    slots: int
    window: tuple[int, int]  # (mel frames, mel bins)
    knobs: int
    coefficients: int
    max_side: int  # the largest frame side a slot holds

    def _fields(self) -> list[tuple[str, np.dtype[Any], tuple[int, ...]]]:
        return [("mel", np.dtype(np.float32), self.window),
                ("knobs", np.dtype(np.float32), (self.knobs,)),
                ("clock", np.dtype(np.float32), (2,)),
                ("coefficients", np.dtype(np.float32), (self.coefficients,)),
                ("frame", np.dtype(np.uint8), (self.max_side, self.max_side, 3))]

    @staticmethod
    def _aligned(nbytes: int) -> int:
        return -(-nbytes // _ALIGN) * _ALIGN

    @property
    def slot_bytes(self) -> int:
        return sum(self._aligned(int(np.prod(shape)) * dtype.itemsize)
                   for _, dtype, shape in self._fields())

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    def views(self, buffer: memoryview) -> list[dict[str, np.ndarray]]:
        """Arrays over each slot's fields, made once: a frame then costs no allocation."""
        out = []
        for index in range(self.slots):
            offset = index * self.slot_bytes
            fields = {}
            for name, dtype, shape in self._fields():
                fields[name] = np.ndarray(shape, dtype, buffer=buffer, offset=offset)
                offset += self._aligned(int(np.prod(shape)) * dtype.itemsize)
            out.append(fields)
        return out


class EngineProcessError(RuntimeError):
    """The engine process failed to start, or died."""


class EngineProcess:
    """The ``Inference`` of ``inference.service``, with the scheduler and engine in a child
    process. ``ring`` slots bound the frames waiting or running at once; a frame submitted
    while all are taken is answered None at once (counted as an overflow drop)."""

    def __init__(self, runtime: str, manifest_path: str | Path, *,
                 engine_opts: dict[str, Any] | None = None, max_batch: int, max_wait_ms: float,
                 max_pending: int, max_side: int, start_timeout_s: float = 600.0,
                 on_batch: Callable[[int, float], None] | None = None,
                 on_drop: Callable[[str], None] | None = None) -> None:
        self.manifest = Manifest.load(manifest_path)
        self.max_batch = max_batch  # the child's choice replaces 0 once it is ready
        self._args = (runtime, str(manifest_path), engine_opts or {}, max_batch, max_wait_ms,
                      max_pending)
        self._start_timeout = start_timeout_s
        self._on_batch = on_batch or (lambda size, seconds: None)
        self._on_drop = on_drop or (lambda reason: None)
        m = self.manifest
        self._max_pending = max_pending
        self._layout_args = dict(window=(m.window_frames, m.features.n_mels),
                                 knobs=len(m.knob_names), coefficients=len(m.coefficient_names),
                                 max_side=max_side)
        self._shm: shared_memory.SharedMemory | None = None
        self._views: list[dict[str, np.ndarray]] = []
        self._free: list[int] = []
        self._waiting: dict[int, asyncio.Future[FrameResult | None]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._sizes: dict[int, int] = {}
        self._capacity: dict[int, float] = {}
        self._conn: Connection | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._ready: asyncio.Future[int] | None = None
        self.dead = False
        self._death = "the engine process is not running"

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        """Start the child, wait until its engine is loaded, then share the ring with it:
        sized for the pending frames plus two batches in flight, the batch size being the
        one the child's engine chose."""
        loop = asyncio.get_running_loop()
        context = multiprocessing.get_context("spawn")  # no inherited threads or CUDA state
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_child_main, name="engine", daemon=True,
                                        args=(child, *self._args))
        self._process.start()
        child.close()
        self._ready = loop.create_future()
        loop.add_reader(self._conn.fileno(), self._on_readable)
        try:
            self.max_batch = await asyncio.wait_for(self._ready, self._start_timeout)
        except BaseException:
            await self.stop()
            raise
        layout = RingLayout(slots=self._max_pending + 2 * self.max_batch, **self._layout_args)
        shm_dir = Path("/dev/shm")
        if shm_dir.is_dir() and shutil.disk_usage(shm_dir).free < layout.nbytes:
            await self.stop()
            raise EngineProcessError(
                f"/dev/shm has {shutil.disk_usage(shm_dir).free / 2**20:.0f} MB free and the "
                f"frame ring needs {layout.nbytes / 2**20:.0f} MB (in a container: --shm-size)")
        self._shm = shared_memory.SharedMemory(create=True, size=layout.nbytes)
        self._views = layout.views(self._shm.buf)
        self._free = list(range(layout.slots))[::-1]
        self._conn.send(("ring", self._shm.name, layout))
        log.info("engine process %d ready (max batch %d, ring of %d slots, %.0f MB)",
                 self._process.pid, self.max_batch, layout.slots, layout.nbytes / 2**20)

    async def stop(self) -> None:
        """End the child and free the ring; every frame still waiting is answered None."""
        if self._conn is not None:
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
            try:
                self._conn.send(("stop",))
            except OSError:
                pass
        if self._process is not None:
            await asyncio.to_thread(self._process.join, 10)
            if self._process.is_alive():
                self._process.kill()
                await asyncio.to_thread(self._process.join, 5)
            self._process = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._fail_everything("engine process stopped", drop_reason="stopped")
        if self._shm is not None:
            self._views = []
            self._shm.close()
            self._shm.unlink()
            self._shm = None

    def _fail_everything(self, reason: str, drop_reason: str = "error") -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_result(None)
                self._on_drop(drop_reason)
        self._waiting.clear()
        for call in self._calls.values():
            if not call.done():
                call.set_exception(EngineProcessError(reason))
        self._calls.clear()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineProcessError(reason))

    # ------------------------------------------------------------------ Inference
    def submit(self, frame: FrameInput, deadline: float) -> asyncio.Future[FrameResult | None]:
        future: asyncio.Future[FrameResult | None] = asyncio.get_running_loop().create_future()
        if self.dead or not self._free or self._conn is None:
            future.set_result(None)
            self._on_drop("error" if self.dead else "overflow")
            return future
        index = self._free.pop()
        slot = self._views[index]
        slot["mel"][:] = frame.mel
        slot["knobs"][:] = frame.knobs
        slot["clock"][:] = frame.clock
        self._waiting[index] = future
        try:
            self._conn.send(("submit", index, frame.slot, deadline))
        except OSError:
            self._died()
        return future

    async def prepare(self, portrait: PreparedPortrait) -> int:
        slot = int(await self._call("prepare", portrait))
        self._sizes[slot] = portrait.size
        return slot

    def release(self, slot: int) -> None:
        if self._sizes.pop(slot, None) is not None and self._conn is not None and not self.dead:
            self._conn.send(("release", slot))

    def frame_size(self, slot: int) -> int:
        try:
            return self._sizes[slot]
        except KeyError:
            raise KeyError(f"unknown or released portrait slot {slot}") from None

    async def warm_up(self, batch: list[FrameInput]) -> None:
        self._capacity.update(await self._call("warm_up", batch))

    def capacity_fps(self, frame_size: int) -> float:
        return self._capacity.get(frame_size, 0.0)

    # ------------------------------------------------------------------ the pipe
    async def _call(self, kind: str, argument: Any) -> Any:
        if self.dead or self._conn is None:
            raise EngineProcessError(self._death)
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._conn.send((kind, call_id, argument))
        return await future

    def _on_readable(self) -> None:
        conn = self._conn
        try:
            while conn is not None and conn.poll():
                self._on_message(conn.recv())
        except (EOFError, OSError):
            self._died()

    def _died(self) -> None:
        if self.dead:
            return
        self.dead = True
        if self._conn is not None:
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
        code = self._process.exitcode if self._process is not None else None
        self._death = "the engine process died" + (f" (exit code {code})" if code else "")
        log.error("%s; its frames are dropped", self._death)
        self._fail_everything(self._death)

    def _on_message(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "done":
            _, index, side = message
            future = self._waiting.pop(index)
            self._free.append(index)
            result = None
            if side:
                slot = self._views[index]
                result = FrameResult(slot["frame"][:side, :side].copy(),
                                     slot["coefficients"].copy())
            if not future.done():
                future.set_result(result)
        elif kind == "batch":
            _, size, seconds, capacity = message
            self._capacity.update(capacity)
            self._on_batch(size, seconds)
        elif kind == "drop":
            self._on_drop(message[1])
        elif kind == "reply":
            _, call_id, ok, value = message
            call = self._calls.pop(call_id)
            if ok:
                call.set_result(value)
            else:
                call.set_exception(EngineProcessError(value))
        elif kind == "ready" and self._ready is not None and not self._ready.done():
            self._ready.set_result(message[1])


# ---------------------------------------------------------------------- the child
def _child_main(conn: Connection, runtime: str, manifest_path: str,
                engine_opts: dict[str, Any], max_batch: int, max_wait_ms: float,
                max_pending: int) -> None:
    # Ctrl-C reaches the whole process group: the parent decides when this process stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_child(conn, runtime, manifest_path, engine_opts, max_batch, max_wait_ms,
                       max_pending))


async def _child(conn: Connection, runtime: str, manifest_path: str,
                 engine_opts: dict[str, Any], max_batch: int, max_wait_ms: float,
                 max_pending: int) -> None:
    from inference.runtimes import create_engine
    from inference.service import InlineInference

    shm: shared_memory.SharedMemory | None = None
    views: list[dict[str, np.ndarray]] = []
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()
    sizes: set[int] = set()

    def send(message: tuple[Any, ...]) -> None:
        try:
            conn.send(message)
        except OSError:  # the parent is gone
            stopped.set()

    engine = await asyncio.to_thread(create_engine, runtime, manifest_path, **engine_opts)
    inference: InlineInference | None = None

    def on_batch(size: int, seconds: float) -> None:
        assert inference is not None
        send(("batch", size, seconds, {s: inference.capacity_fps(s) for s in sizes}))

    inference = InlineInference(engine, max_batch=max_batch, max_wait_ms=max_wait_ms,
                                max_pending=max_pending, on_batch=on_batch,
                                on_drop=lambda reason: send(("drop", reason)))
    await inference.start()
    gc.collect()
    gc.freeze()  # a full collection over the engine's start-up objects would stall batches

    def finished(index: int, future: asyncio.Future[FrameResult | None]) -> None:
        result = None if future.cancelled() else future.result()
        if result is None:
            send(("done", index, 0))
            return
        side = result.frame.shape[0]
        views[index]["frame"][:side, :side] = result.frame
        views[index]["coefficients"][:] = result.coefficients
        send(("done", index, side))

    async def reply(call_id: int, work: Any) -> None:
        try:
            send(("reply", call_id, True, await work))
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller
            send(("reply", call_id, False, f"{type(exc).__name__}: {exc}"))

    async def prepare(portrait: PreparedPortrait) -> int:
        slot = await inference.prepare(portrait)
        sizes.add(portrait.size)
        return slot

    async def warm_up(batch: list[FrameInput]) -> dict[int, float]:
        await inference.warm_up(batch)
        return {s: inference.capacity_fps(s) for s in sizes}

    tasks: set[asyncio.Task[None]] = set()

    def on_readable() -> None:
        nonlocal shm, views
        try:
            while conn.poll():
                message = conn.recv()
                kind = message[0]
                if kind == "submit":
                    _, index, slot, deadline = message
                    # Views, not copies: the parent reuses a slot only once it is answered.
                    v = views[index]
                    frame = FrameInput(slot, v["mel"], v["knobs"], v["clock"])
                    inference.submit(frame, deadline).add_done_callback(
                        functools.partial(finished, index))
                elif kind == "release":
                    inference.release(message[1])
                elif kind == "ring":
                    _, name, layout = message
                    # A spawned child shares its parent's resource tracker: attaching
                    # registers nothing new, and the parent alone unlinks the ring.
                    shm = shared_memory.SharedMemory(name=name)
                    views = layout.views(shm.buf)
                elif kind in ("prepare", "warm_up"):
                    _, call_id, argument = message
                    work = prepare(argument) if kind == "prepare" else warm_up(argument)
                    task = loop.create_task(reply(call_id, work))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                elif kind == "stop":
                    stopped.set()
                    return
        except (EOFError, OSError):
            stopped.set()

    loop.add_reader(conn.fileno(), on_readable)
    send(("ready", inference.max_batch))
    await stopped.wait()
    loop.remove_reader(conn.fileno())
    await inference.stop()
    views.clear()
    if shm is not None:
        shm.close()
