"""The inference process's side of the wire: the shared scheduler and engine, and the
media workers connected to it.

``InferenceCore`` serves any ``CoreService`` (in the process, ``InlineInference``; in a
unit test, a fake) to the workers that connect to its Unix socket; ``serve`` is the
process around it: it loads the engine, reports batches and drops to the front door, and
ends the process if the engine wedges.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from multiprocessing import AuthenticationError, shared_memory
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any, Protocol

import numpy as np

from inference.child_process import Ready, until_stopped, watch_connection
from inference.engine import NO_PICTURE, FrameInput, PreparedPortrait
from inference.process.messages import (
    Batch,
    Capacity,
    Done,
    DoneItem,
    Drop,
    Hello,
    Prepare,
    Refused,
    Release,
    Reply,
    Ring,
    Stopping,
    Submit,
    ToFrontDoor,
    ToWorker,
    WarmUp,
)
from inference.process.outbox import Outbox
from inference.scheduler import FrameResult
from inference.service import InferenceConfig, start_inline

log = logging.getLogger(__name__)

#: Capacity figures go to the workers at most this often (they only feed admission).
CAPACITY_EVERY_S = 0.5
#: An engine stuck in one batch this long will not come back by itself (a wedged GPU
#: call cannot be cancelled from Python): the process exits, and the front door starts a
#: fresh one with its workers.
ENGINE_STUCK_S = 10.0


class CoreService(Protocol):
    """What the core asks of the shared scheduler and engine (``InlineInference``)."""

    max_batch: int

    def submit(self, frame: FrameInput, deadline: float, *, picture: bool = True
               ) -> asyncio.Future[FrameResult | None]: ...

    async def prepare(self, portrait: PreparedPortrait) -> int: ...

    def release(self, slot: int) -> None: ...

    async def warm_up(self, batch: list[FrameInput], *, picture: bool = True) -> None: ...

    def capacity_fps(self, frame_size: int) -> float: ...


class WorkerConnection:
    """One connected media worker: its ring, its portraits and its frames in flight."""

    def __init__(self, conn: Connection, core: InferenceCore) -> None:
        self.conn = conn
        self.core = core
        self.service = core.service
        self.loop = asyncio.get_running_loop()
        self.shm: shared_memory.SharedMemory | None = None
        self.views: list[dict[str, np.ndarray]] = []
        self.slots: set[int] = set()
        self.in_flight = 0
        self.gone = False
        self.tasks: set[asyncio.Task[None]] = set()
        self.done: Outbox[DoneItem, Done] = Outbox(Done, self.send)
        watch_connection(self.loop, conn, self.on_readable)
        self.send(Hello(self.service.max_batch, core.capacity()))

    def send(self, message: ToWorker) -> None:
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

    def on_message(self, message: object) -> None:
        match message:
            case Submit(items):
                for index, slot, deadline in items:
                    self.submit(index, slot, deadline)
            case Release(slot):
                if slot in self.slots:
                    self.slots.discard(slot)
                    self.service.release(slot)
            case Ring(name, layout):
                # A spawned process shares its parent's resource tracker: attaching
                # registers nothing new, and the worker (or the front door, if it died)
                # unlinks the ring.
                self.shm = shared_memory.SharedMemory(name=name)
                self.views = layout.views(self.shm.buf)
            case Prepare(call_id, portrait):
                self.answer(call_id, self.prepare(portrait))
            case WarmUp(call_id, batch, picture):
                self.answer(call_id, self.warm_up(batch, picture))
            case _:
                # Refused, not ignored: a call would otherwise wait for ever.
                log.warning("a worker sent a message this process does not take: %.200r",
                            message)
                self.send(Refused(getattr(message, "call_id", None),
                                  f"the inference process takes no {type(message).__name__}"))

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

    def answer(self, call_id: int, work: Awaitable[Any]) -> None:
        """Run a call off this handler; its result (or its failure) goes back as it ends."""
        task = self.loop.create_task(self.reply(call_id, work))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def reply(self, call_id: int, work: Awaitable[Any]) -> None:
        try:
            self.send(Reply(call_id, await work))
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller
            self.send(Refused(call_id, f"{type(exc).__name__}: {exc}"))

    async def prepare(self, portrait: PreparedPortrait) -> int:
        slot = await self.service.prepare(portrait)
        self.core.sizes.add(portrait.size)
        if self.gone:
            self.service.release(slot)
        else:
            self.slots.add(slot)
        return slot

    async def warm_up(self, batch: list[FrameInput], picture: bool) -> dict[int, float]:
        await self.service.warm_up(batch, picture=picture)
        return self.core.capacity()

    def disconnect(self) -> None:
        """The worker left (or died): its portraits leave the engine, its ring is let go
        once no frame of its is in the engine."""
        if self.gone:
            return
        self.gone = True
        self.core.workers.discard(self)
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


def handshake(conn: Connection, authkey: bytes) -> None:
    """Both sides prove they know the key, as ``multiprocessing.connection.Listener``
    does (it blocks on the worker's answers)."""
    deliver_challenge(conn, authkey)
    answer_challenge(conn, authkey)


class InferenceCore:
    """The shared scheduler and engine (``service``) and the media workers connected to
    it: a batch spans every worker's frames."""

    def __init__(self, service: CoreService) -> None:
        self.service = service
        self.loop = asyncio.get_running_loop()
        self.sizes: set[int] = set()
        self.workers: set[WorkerConnection] = set()
        self._capacity_sent = 0.0
        self._listening: socket.socket | None = None
        self._address = ""
        self._authkey = b""
        self._handshakes: set[asyncio.Task[None]] = set()

    def capacity(self) -> dict[int, float]:
        """Engine frames per second by frame size, NO_PICTURE (coefficients alone) too."""
        return {s: self.service.capacity_fps(s) for s in (*self.sizes, NO_PICTURE)}

    def batch_ran(self) -> None:
        """After each batch: the capacity figures go to every worker, at most every
        ``CAPACITY_EVERY_S``."""
        if self.loop.time() - self._capacity_sent > CAPACITY_EVERY_S:
            self._capacity_sent = self.loop.time()
            figures = self.capacity()
            for worker in list(self.workers):
                worker.send(Capacity(figures))

    def listen(self, address: str, authkey: bytes) -> None:
        """Take workers that connect to the Unix socket ``address`` knowing ``authkey``.
        The loop accepts; each handshake runs on a thread (it blocks on the worker), so
        a worker with the wrong key, or one gone mid-handshake, costs nothing else."""
        if os.path.exists(address):
            os.unlink(address)  # left by a predecessor that died
        listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listening.bind(address)
        listening.listen()
        listening.setblocking(False)
        self._listening, self._address, self._authkey = listening, address, authkey
        self.loop.add_reader(listening.fileno(), self._accept)

    def _accept(self) -> None:
        if self._listening is None:
            return
        try:
            raw, _ = self._listening.accept()
        except (BlockingIOError, InterruptedError):
            return
        raw.setblocking(True)
        task = self.loop.create_task(self._welcome(Connection(raw.detach())))
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    async def _welcome(self, conn: Connection) -> None:
        try:
            await asyncio.to_thread(handshake, conn, self._authkey)
        except (AuthenticationError, EOFError, OSError) as exc:
            log.warning("refused a connection: %s: %s", type(exc).__name__, exc)
            conn.close()
            return
        if self._listening is None:  # closed meanwhile
            conn.close()
            return
        self.workers.add(WorkerConnection(conn, self))

    def close(self) -> None:
        """Take no more workers; tell each connected one that this process is stopping
        (so it does not take it for dead), and let it go."""
        if self._listening is not None:
            self.loop.remove_reader(self._listening.fileno())
            self._listening.close()
            self._listening = None
            try:
                os.unlink(self._address)
            except FileNotFoundError:
                pass
        for worker in list(self.workers):
            worker.send(Stopping())
            worker.disconnect()


async def watch_engine(stalled_s: Callable[[], float]) -> None:
    """Exit the process once the engine has been stuck in one batch ``ENGINE_STUCK_S``."""
    while True:
        await asyncio.sleep(1.0)
        stalled = stalled_s()
        if stalled > ENGINE_STUCK_S:
            log.error("the engine has been stuck in one batch for %.0f s past its "
                      "expected end; exiting for a fresh inference process", stalled)
            logging.shutdown()
            os._exit(70)


async def serve(control: Connection, config: InferenceConfig, address: str,
                authkey: bytes) -> None:
    """The inference process: load the engine, then serve workers at ``address`` until
    the front door says ``Stop`` (or is gone). Batches and drops go to the front door."""
    if config.device is not None:  # before the runtime imports CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = str(config.device)

    def tell(message: ToFrontDoor | Ready) -> None:
        try:
            control.send(message)
        except OSError:  # the front door is gone; until_stopped ends this process
            pass

    core: InferenceCore | None = None  # once the engine is loaded

    def on_batch(size: int, seconds: float) -> None:
        tell(Batch(size, seconds))
        if core is not None:
            core.batch_ran()

    service = await start_inline(config, on_batch=on_batch,
                                 on_drop=lambda reason: tell(Drop(reason)))
    gc.collect()
    gc.freeze()  # a full collection over the engine's start-up objects would stall batches
    core = InferenceCore(service)
    core.listen(address, authkey)
    tell(Ready(service.max_batch))
    watch = asyncio.get_running_loop().create_task(watch_engine(service.scheduler.stalled_s))
    await until_stopped(control)
    watch.cancel()
    core.close()
    await service.stop()
