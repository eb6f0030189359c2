"""The inference process: the shared scheduler and the engine, serving every media worker.

One Python process cannot carry a GPU's worth of sessions: the engine's Python side
(packing inputs, launching, waiting for copies) queues for the GIL behind the media side's
event loop. Measured on an H200, a batch of one took 1.82 ms instead of 0.33 with 256
sessions' submissions on the same loop (BENCHMARKS.md). So one process per GPU owns the
scheduler and the engine, and media workers connect to it over a Unix socket
(``multiprocessing.connection``: authenticated, framed, from the standard library). Each
worker shares a ring of frame slots with it in shared memory: the worker writes a frame's
inputs into a slot and sends the slot's number; the process answers with that number once
the frame (I420, half the bytes of RGB) and its coefficients are in the same slot. Only
slot numbers, deadlines and short replies cross the socket; a portrait crosses it once.
One scheduler sees every worker's frames, so a batch spans all of them.

Deadlines are event-loop times, which every process reads from the same monotonic clock.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import logging
import multiprocessing
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

import numpy as np

from inference.child_process import (
    ChildProcess,
    ChildProcessError,
    until_stopped,
    watch_connection,
)
from inference.engine import NO_PICTURE, FrameInput, Manifest, PreparedPortrait
from inference.pixels import I420, frame_shape
from inference.scheduler import FrameResult
from inference.service import InferenceConfig, start_inline

log = logging.getLogger(__name__)

_ALIGN = 64
#: Capacity figures go to the workers at most this often (they only feed admission).
CAPACITY_EVERY_S = 0.5
#: An engine stuck in one batch this long will not come back by itself (a wedged GPU
#: call cannot be cancelled from Python): the process exits, and the front door starts a
#: fresh one with its workers.
ENGINE_STUCK_S = 10.0
#: What a motion-only frame carries instead of its picture.
_NO_PICTURE = np.empty(frame_shape(I420, 0), np.uint8)
_NO_PICTURE.flags.writeable = False


@dataclass(frozen=True)
class RingLayout:
    """Where each slot's inputs and outputs lie in a worker's shared ring: ``slots`` slots
    with room for an I420 frame (the top left of the field, for a side below
    ``max_side``), then ``motion_slots`` without (motion-only sessions need only
    the coefficients back, so thousands of them fit in a few megabytes)."""

    slots: int
    window: tuple[int, int]  # (mel frames, mel bins)
    knobs: int
    coefficients: int
    max_side: int  # the largest frame side a slot holds
    motion_slots: int = 0

    def _fields(self, side: int) -> list[tuple[str, np.dtype[Any], tuple[int, ...]]]:
        return [("mel", np.dtype(np.float32), self.window),
                ("knobs", np.dtype(np.float32), (self.knobs,)),
                ("clock", np.dtype(np.float32), (2,)),
                ("coefficients", np.dtype(np.float32), (self.coefficients,)),
                ("frame", np.dtype(np.uint8), frame_shape(I420, side))]

    @staticmethod
    def _aligned(nbytes: int) -> int:
        return -(-nbytes // _ALIGN) * _ALIGN

    def slot_bytes(self, side: int) -> int:
        return sum(self._aligned(int(np.prod(shape)) * dtype.itemsize)
                   for _, dtype, shape in self._fields(side))

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes(self.max_side) + \
            self.motion_slots * self.slot_bytes(0)

    def views(self, buffer: memoryview) -> list[dict[str, np.ndarray]]:
        """Arrays over each slot's fields, made once: a frame then costs no allocation."""
        out = []
        offset = 0
        for index in range(self.slots + self.motion_slots):
            fields = {}
            for name, dtype, shape in self._fields(self.max_side if index < self.slots else 0):
                fields[name] = np.ndarray(shape, dtype, buffer=buffer, offset=offset)
                offset += self._aligned(int(np.prod(shape)) * dtype.itemsize)
            out.append(fields)
        return out


class InferenceProcessError(RuntimeError):
    """The inference process failed to start, refused a call, or died."""


def unlink_ring(name: str) -> bool:
    """Remove a ring whose worker died without removing it; False if it was gone."""
    try:
        ring = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return False
    ring.close()
    ring.unlink()
    return True


class Outbox:
    """Items of one kind for a connection, sent together at the end of the loop's current
    round: the frames of every session due at one instant of the media grid
    (``server.media_clock.on_grid``) cross the socket as one message, and so do the frames
    of one batch coming back, rather than a message, a write and a wake-up of the other
    process each."""

    def __init__(self, kind: str, send: Callable[[tuple[Any, ...]], None]) -> None:
        self._kind = kind
        self._send = send
        self._items: list[tuple[Any, ...]] = []

    def put(self, item: tuple[Any, ...]) -> None:
        if not self._items:
            asyncio.get_running_loop().call_soon(self._flush)
        self._items.append(item)

    def _flush(self) -> None:
        items, self._items = self._items, []
        self._send((self._kind, items))


# ---------------------------------------------------------------------- the front door's handle
class InferenceProcess:
    """Starts and stops the inference process, and hears its batches and drops.

    ``address`` is the Unix socket workers connect to with ``authkey``. ``on_exit`` is
    called (on the loop) if the process ends without being asked to.
    """

    def __init__(self, config: InferenceConfig, address: str, authkey: bytes, *,
                 on_batch: Callable[[int, float], None] | None = None,
                 on_drop: Callable[[str], None] | None = None,
                 on_exit: Callable[[int | None], None] | None = None,
                 start_timeout_s: float = 600.0) -> None:
        self.config = config
        self.address = address
        self.authkey = authkey
        self.max_batch = config.max_batch
        on_batch = on_batch or (lambda size, seconds: None)
        on_drop = on_drop or (lambda reason: None)

        def on_message(message: tuple[Any, ...]) -> None:
            if message[0] == "batch":
                on_batch(message[1], message[2])
            elif message[0] == "drop":
                on_drop(message[1])

        self.child = ChildProcess(f"inference-{config.device or 0}", _serve,
                                  (config, address, authkey), on_message=on_message,
                                  on_exit=on_exit, start_timeout_s=start_timeout_s)

    @property
    def pid(self) -> int | None:
        return self.child.pid

    @property
    def alive(self) -> bool:
        return self.child.alive

    async def start(self) -> int:
        """Start it and wait until its engine is loaded; returns its batch size."""
        try:
            self.max_batch = int(await self.child.start())
        except ChildProcessError as exc:
            raise InferenceProcessError(str(exc)) from exc
        return self.max_batch

    async def stop(self) -> None:
        await self.child.stop()

    def kill(self) -> None:
        """End it at once, as a crash would (for tests of recovery)."""
        self.child.kill()


# ---------------------------------------------------------------------- a worker's client
class RemoteInference:
    """The ``Inference`` of ``inference.service`` for a media worker: frames go to the
    inference process at ``address`` through a shared ring of ``pending`` slots plus two
    batches, and ``motion_pending`` slots without a picture. A frame submitted while every
    slot is taken is answered None at once (an overflow drop); so is every frame once the
    process is gone (``dead``)."""

    def __init__(self, manifest: Manifest, address: str, authkey: bytes, *, pending: int,
                 max_side: int, motion_pending: int = 0, ring_name: str | None = None,
                 on_drop: Callable[[str], None] | None = None) -> None:
        self.manifest = manifest
        self.max_batch = 0  # the process's choice, once connected
        self._address = address
        self._authkey = authkey
        self._pending = pending
        self._motion_pending = motion_pending
        self._ring_name = ring_name
        self._on_drop = on_drop or (lambda reason: None)
        m = manifest
        self._layout_args = dict(window=(m.window_frames, m.features.n_mels),
                                 knobs=len(m.knob_names), coefficients=len(m.coefficient_names),
                                 max_side=max_side)
        self._shm: shared_memory.SharedMemory | None = None
        self._views: list[dict[str, np.ndarray]] = []
        self._free: list[int] = []
        self._free_motion: list[int] = []
        self._waiting: dict[int, asyncio.Future[FrameResult | None]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._sizes: dict[int, int] = {}
        self._capacity: dict[int, float] = {}
        self._conn: Connection | None = None
        self._hello: asyncio.Future[tuple[int, dict[int, float]]] | None = None
        self.dead = False
        self._death = "not connected to the inference process"
        self._stopping = False
        self._submits = Outbox("submit", self._send)

    @property
    def ring_name(self) -> str | None:
        return self._shm.name if self._shm is not None else None

    async def start(self) -> None:
        """Connect, learn the batch size, then share a ring sized for it."""
        loop = asyncio.get_running_loop()
        try:
            self._conn = await asyncio.to_thread(Client, self._address, "AF_UNIX",
                                                 authkey=self._authkey)
        except (OSError, multiprocessing.AuthenticationError) as exc:
            raise InferenceProcessError(f"cannot reach the inference process at "
                                        f"{self._address}: {exc}") from exc
        self._hello = loop.create_future()
        watch_connection(loop, self._conn, self._on_readable)
        self.max_batch, capacity = await self._hello
        self._capacity.update(capacity)
        layout = RingLayout(slots=self._pending + 2 * self.max_batch,
                            motion_slots=self._motion_pending, **self._layout_args)
        shm_dir = Path("/dev/shm")
        if shm_dir.is_dir() and shutil.disk_usage(shm_dir).free < layout.nbytes:
            await self.stop()
            raise InferenceProcessError(
                f"/dev/shm has {shutil.disk_usage(shm_dir).free / 2**20:.0f} MB free and the "
                f"frame ring needs {layout.nbytes / 2**20:.0f} MB (in a container: --shm-size)")
        self._shm = shared_memory.SharedMemory(name=self._ring_name, create=True,
                                               size=layout.nbytes)
        self._views = layout.views(self._shm.buf)
        self._free = list(range(layout.slots))[::-1]
        self._free_motion = list(range(layout.slots, layout.slots + layout.motion_slots))[::-1]
        self._conn.send(("ring", self._shm.name, layout))
        self._death = "the inference process died"
        log.info("connected to the inference process (max batch %d, ring of %d slots, %.0f MB)",
                 self.max_batch, layout.slots, layout.nbytes / 2**20)

    async def stop(self) -> None:
        """Disconnect and free the ring; every frame still waiting is answered None."""
        if self._conn is not None:
            if not self.dead:
                asyncio.get_running_loop().remove_reader(self._conn.fileno())
            self._conn.close()
            self._conn = None
        self.dead = True
        self._fail_everything("disconnected from the inference process", drop_reason="stopped")
        if self._shm is not None:
            self._views = []
            self._shm.close()
            try:
                self._shm.unlink()
            except FileNotFoundError:  # removed for us (unlink_ring)
                pass
            self._shm = None

    def _fail_everything(self, reason: str, drop_reason: str = "error") -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_result(None)
                self._on_drop(drop_reason)
        self._waiting.clear()
        for call in self._calls.values():
            if not call.done():
                call.set_exception(InferenceProcessError(reason))
        self._calls.clear()
        if self._hello is not None and not self._hello.done():
            self._hello.set_exception(InferenceProcessError(reason))

    # ------------------------------------------------------------------ Inference
    def submit(self, frame: FrameInput, deadline: float, *, picture: bool = True
               ) -> asyncio.Future[FrameResult | None]:
        future: asyncio.Future[FrameResult | None] = asyncio.get_running_loop().create_future()
        free = self._free if picture else self._free_motion
        if self.dead or not free or self._conn is None:
            future.set_result(None)
            self._on_drop("error" if self.dead else "overflow")
            return future
        index = free.pop()
        slot = self._views[index]
        slot["mel"][:] = frame.mel
        slot["knobs"][:] = frame.knobs
        slot["clock"][:] = frame.clock
        self._waiting[index] = future
        self._submits.put((index, frame.slot, deadline))
        return future

    async def prepare(self, portrait: PreparedPortrait) -> int:
        slot = int(await self._call("prepare", portrait))
        self._sizes[slot] = portrait.size
        return slot

    def release(self, slot: int) -> None:
        if self._sizes.pop(slot, None) is not None:
            self._send(("release", slot))

    def frame_size(self, slot: int) -> int:
        try:
            return self._sizes[slot]
        except KeyError:
            raise KeyError(f"unknown or released portrait slot {slot}") from None

    async def warm_up(self, batch: list[FrameInput], *, picture: bool = True) -> None:
        self._capacity.update(await self._call("warm_up", (batch, picture)))

    def capacity_fps(self, frame_size: int) -> float:
        return self._capacity.get(frame_size, 0.0)

    # ------------------------------------------------------------------ the socket
    def _send(self, message: tuple[Any, ...]) -> None:
        if self._conn is None or self.dead:
            return
        try:
            self._conn.send(message)
        except OSError:
            self._died()

    async def _call(self, kind: str, argument: Any) -> Any:
        if self.dead or self._conn is None:
            raise InferenceProcessError(self._death)
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

    def _done(self, index: int, side: int | None) -> None:
        future = self._waiting.pop(index)
        slot = self._views[index]
        picture = slot["frame"].shape[0] > 0
        (self._free if picture else self._free_motion).append(index)
        result = None
        if side is not None:  # None: dropped
            height, width = frame_shape(I420, side)
            result = FrameResult(slot["frame"][:height, :width].copy() if picture
                                 else _NO_PICTURE, slot["coefficients"].copy())
        if not future.done():
            future.set_result(result)

    def _died(self) -> None:
        if self.dead:
            return
        self.dead = True
        if self._conn is not None:
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
        # A process that said it was stopping (the server shutting down) did not die.
        (log.info if self._stopping else log.error)("%s; its frames are dropped", self._death)
        self._fail_everything(self._death)

    def _on_message(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "done":
            for index, side in message[1]:
                self._done(index, side)
        elif kind == "capacity":
            self._capacity.update(message[1])
        elif kind == "reply":
            _, call_id, ok, value = message
            call = self._calls.pop(call_id)
            if ok:
                call.set_result(value)
            else:
                call.set_exception(InferenceProcessError(value))
        elif kind == "stopping":
            self._stopping = True
            self._death = "the inference process stopped"
        elif kind == "hello" and self._hello is not None and not self._hello.done():
            self._hello.set_result((message[1], message[2]))


class EngineProcess(RemoteInference):
    """An inference process of its own with one client: the engine out of this process's
    GIL without the front door (benchmarks, tests)."""

    def __init__(self, runtime: str, manifest_path: str | Path, *,
                 engine_opts: dict[str, Any] | None = None, max_batch: int, max_wait_ms: float,
                 max_pending: int, max_side: int, start_timeout_s: float = 600.0,
                 on_batch: Callable[[int, float], None] | None = None,
                 on_drop: Callable[[str], None] | None = None) -> None:
        self._dir = tempfile.mkdtemp(prefix="sonic-engine-")
        authkey = secrets.token_bytes(16)
        address = os.path.join(self._dir, "inference.sock")
        super().__init__(Manifest.load(manifest_path), address, authkey, pending=max_pending,
                         max_side=max_side, on_drop=on_drop)
        config = InferenceConfig(runtime, str(manifest_path), engine_opts or {}, max_batch,
                                 max_wait_ms, max_pending)
        self.process = InferenceProcess(config, address, authkey, on_batch=on_batch,
                                        on_drop=on_drop, start_timeout_s=start_timeout_s)

    async def start(self) -> None:
        await self.process.start()
        try:
            await super().start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        await super().stop()
        await self.process.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


# ---------------------------------------------------------------------- the process itself
class _Worker:
    """One connected media worker: its ring, its portraits and its frames in flight."""

    def __init__(self, conn: Connection, server: _Server) -> None:
        self.conn = conn
        self.server = server
        self.service = server.service
        self.loop = asyncio.get_running_loop()
        self.shm: shared_memory.SharedMemory | None = None
        self.views: list[dict[str, np.ndarray]] = []
        self.slots: set[int] = set()
        self.in_flight = 0
        self.gone = False
        self.tasks: set[asyncio.Task[None]] = set()
        self.done = Outbox("done", self.send)
        watch_connection(self.loop, conn, self.on_readable)
        self.send(("hello", self.service.max_batch, server.capacity()))

    def send(self, message: tuple[Any, ...]) -> None:
        if self.gone:
            return
        try:
            self.conn.send(message)
        except OSError:
            self.disconnect()

    def on_readable(self) -> None:
        try:
            while not self.gone and self.conn.poll():
                self.on_message(self.conn.recv())
        except (EOFError, OSError):
            self.disconnect()

    def on_message(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "submit":
            for index, slot, deadline in message[1]:
                self.submit(index, slot, deadline)
        elif kind == "release":
            if message[1] in self.slots:
                self.slots.discard(message[1])
                self.service.release(message[1])
        elif kind == "ring":
            _, name, layout = message
            # A spawned process shares its parent's resource tracker: attaching registers
            # nothing new, and the worker (or the front door, if it died) unlinks the ring.
            self.shm = shared_memory.SharedMemory(name=name)
            self.views = layout.views(self.shm.buf)
        elif kind in ("prepare", "warm_up"):
            _, call_id, argument = message
            work = self.prepare(argument) if kind == "prepare" else self.warm_up(argument)
            task = self.loop.create_task(self.reply(call_id, work))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def submit(self, index: int, slot: int, deadline: float) -> None:
        # Views, not copies: the worker reuses a slot only once it is answered.
        v = self.views[index]
        try:
            future = self.service.submit(FrameInput(slot, v["mel"], v["knobs"], v["clock"]),
                                         deadline, picture=bool(v["frame"].shape[0]))
        except KeyError:  # a portrait released meanwhile
            self.done.put((index, None))
            return
        self.in_flight += 1
        future.add_done_callback(functools.partial(self.finished, index))

    def finished(self, index: int, future: asyncio.Future[FrameResult | None]) -> None:
        self.in_flight -= 1
        if self.gone:
            self._close_ring()
            return
        result = None if future.cancelled() else future.result()
        if result is None:
            self.done.put((index, None))
            return
        height, width = result.frame.shape[:2]  # 0: the coefficients alone
        view = self.views[index]
        if width:
            view["frame"][:height, :width] = result.frame
        view["coefficients"][:] = result.coefficients
        self.done.put((index, width))

    async def reply(self, call_id: int, work: Any) -> None:
        try:
            self.send(("reply", call_id, True, await work))
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller
            self.send(("reply", call_id, False, f"{type(exc).__name__}: {exc}"))

    async def prepare(self, portrait: PreparedPortrait) -> int:
        slot = await self.service.prepare(portrait)
        self.server.sizes.add(portrait.size)
        if self.gone:
            self.service.release(slot)
        else:
            self.slots.add(slot)
        return slot

    async def warm_up(self, shape: tuple[list[FrameInput], bool]) -> dict[int, float]:
        batch, picture = shape
        await self.service.warm_up(batch, picture=picture)
        return self.server.capacity()

    def disconnect(self) -> None:
        """The worker left (or died): its portraits leave the engine, its ring is let go
        once no frame of its is in the engine."""
        if self.gone:
            return
        self.gone = True
        self.server.workers.discard(self)
        self.loop.remove_reader(self.conn.fileno())
        self.conn.close()
        for slot in self.slots:
            self.service.release(slot)
        self.slots.clear()
        self._close_ring()

    def _close_ring(self) -> None:
        if self.in_flight or self.shm is None:
            return
        self.views = []
        try:
            self.shm.close()
        except BufferError:  # a finished batch still holds a view; its collection frees it
            pass
        self.shm = None


class _Server:
    """The scheduler and engine, the front door's control pipe, and the connected workers."""

    def __init__(self, control: Connection, config: InferenceConfig) -> None:
        self.control = control
        self.config = config
        self.loop = asyncio.get_running_loop()
        self.sizes: set[int] = set()
        self.workers: set[_Worker] = set()
        self.service: Any = None  # InlineInference, once the engine is loaded
        self._capacity_sent = 0.0

    def tell_front_door(self, message: tuple[Any, ...]) -> None:
        try:
            self.control.send(message)
        except OSError:  # the front door is gone; until_stopped ends this process
            pass

    def capacity(self) -> dict[int, float]:
        """Engine frames per second by frame size, NO_PICTURE (coefficients alone) too."""
        return {s: self.service.capacity_fps(s) for s in (*self.sizes, NO_PICTURE)}

    def on_batch(self, size: int, seconds: float) -> None:
        self.tell_front_door(("batch", size, seconds))
        if self.loop.time() - self._capacity_sent > CAPACITY_EVERY_S:
            self._capacity_sent = self.loop.time()
            figures = self.capacity()
            for worker in list(self.workers):
                worker.send(("capacity", figures))

    async def watch_engine(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            stalled = self.service.scheduler.stalled_s()
            if stalled > ENGINE_STUCK_S:
                log.error("the engine has been stuck in one batch for %.0f s past its "
                          "expected end; exiting for a fresh inference process", stalled)
                logging.shutdown()
                os._exit(70)

    def accept_forever(self, listener: Listener) -> None:
        """On a thread: the handshake blocks, and a bad key must not stop the loop."""
        from multiprocessing import AuthenticationError
        while True:
            try:
                conn = listener.accept()
            except AuthenticationError:
                continue
            except OSError:  # the listener was closed: stopping
                return
            self.loop.call_soon_threadsafe(lambda c=conn: self.workers.add(_Worker(c, self)))

    async def run(self, address: str, authkey: bytes) -> None:
        self.service = await start_inline(
            self.config, on_batch=self.on_batch,
            on_drop=lambda reason: self.tell_front_door(("drop", reason)))
        gc.collect()
        gc.freeze()  # a full collection over the engine's start-up objects would stall batches
        if os.path.exists(address):
            os.unlink(address)  # left by a predecessor that died
        listener = Listener(address, "AF_UNIX", authkey=authkey)
        threading.Thread(target=self.accept_forever, args=(listener,), name="accept",
                         daemon=True).start()
        self.tell_front_door(("ready", self.service.max_batch))
        watch = self.loop.create_task(self.watch_engine())
        await until_stopped(self.control)
        watch.cancel()
        listener.close()
        for worker in list(self.workers):
            worker.send(("stopping",))
            worker.disconnect()
        await self.service.stop()


async def _serve(control: Connection, config: InferenceConfig, address: str,
                 authkey: bytes) -> None:
    if config.device is not None:  # before the runtime imports CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = str(config.device)
    await _Server(control, config).run(address, authkey)
