"""A media worker's ``Inference`` (``inference.service``): its frames go to the inference
process through a shared ring, and come back in it."""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import shutil
from collections.abc import Callable
from multiprocessing import shared_memory
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any

import numpy as np

from inference.child_process import watch_connection
from inference.engine import FrameInput, Manifest, PreparedPortrait
from inference.pixels import I420, frame_shape
from inference.process import InferenceProcessError
from inference.process.messages import (
    Call,
    Capacity,
    Done,
    Hello,
    Prepare,
    Refused,
    Release,
    Reply,
    Ring,
    Stopping,
    Submit,
    SubmitItem,
    ToCore,
    WarmUp,
)
from inference.process.outbox import Outbox
from inference.process.ring import RingLayout
from inference.scheduler import FrameResult

log = logging.getLogger(__name__)

#: What a motion-only frame carries instead of its picture.
NO_PICTURE_FRAME = np.empty(frame_shape(I420, 0), np.uint8)
NO_PICTURE_FRAME.flags.writeable = False


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
        self._hello: asyncio.Future[Hello] | None = None
        self.dead = False
        self._death = "not connected to the inference process"
        self._stopping = False
        self._submits: Outbox[SubmitItem, Submit] = Outbox(Submit, self._send)

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
        hello = await self._hello
        self.max_batch = hello.max_batch
        self._capacity.update(hello.capacity)
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
        self._conn.send(Ring(self._shm.name, layout))
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
        slot = int(await self._call(Prepare(next(self._call_ids), portrait)))
        self._sizes[slot] = portrait.size
        return slot

    def release(self, slot: int) -> None:
        if self._sizes.pop(slot, None) is not None:
            self._send(Release(slot))

    def frame_size(self, slot: int) -> int:
        try:
            return self._sizes[slot]
        except KeyError:
            raise KeyError(f"unknown or released portrait slot {slot}") from None

    async def warm_up(self, batch: list[FrameInput], *, picture: bool = True) -> None:
        self._capacity.update(await self._call(WarmUp(next(self._call_ids), batch, picture)))

    def capacity_fps(self, frame_size: int) -> float:
        return self._capacity.get(frame_size, 0.0)

    # ------------------------------------------------------------------ the socket
    def _send(self, message: ToCore) -> None:
        if self._conn is None or self.dead:
            return
        try:
            self._conn.send(message)
        except OSError:
            self._died()

    async def _call(self, message: Call) -> Any:
        if self.dead or self._conn is None:
            raise InferenceProcessError(self._death)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[message.call_id] = future
        self._conn.send(message)
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
                                 else NO_PICTURE_FRAME, slot["coefficients"].copy())
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

    def _on_message(self, message: object) -> None:
        match message:
            case Done(items):
                for index, side in items:
                    self._done(index, side)
            case Capacity(figures):
                self._capacity.update(figures)
            case Reply(call_id, value):
                self._calls.pop(call_id).set_result(value)
            case Refused(None, reason):
                log.error("the inference process refused a message: %s", reason)
            case Refused(call_id, reason):
                self._calls.pop(call_id).set_exception(InferenceProcessError(reason))
            case Stopping():
                self._stopping = True
                self._death = "the inference process stopped"
            case Hello() if self._hello is not None and not self._hello.done():
                self._hello.set_result(message)
            case _:
                log.warning("ignored a message from the inference process: %.200r", message)
