"""The front door's handle on an inference process: start it, stop it, hear its batches
and drops, learn when it dies."""

from __future__ import annotations

from collections.abc import Callable

from inference.child_process import ChildProcess, ChildProcessError
from inference.process import InferenceProcessError
from inference.process.core import serve
from inference.process.messages import Batch, Drop
from inference.service import InferenceConfig


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

        def on_message(message: object) -> None:
            match message:
                case Batch(size, seconds):
                    on_batch(size, seconds)
                case Drop(reason):
                    on_drop(reason)

        self.child = ChildProcess(f"inference-{config.device or 0}", serve,
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
