"""A session recorded to MP4 as its viewers get it: the frames they are shown and the
delayed audio they hear, each stamped on the session's media clock, so lips and sound
line up in the file as they did live. Written with the offline render's own writer
(``inference.mp4``); encoding runs on one thread of its own, off the event loop."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from inference.mp4 import Mp4Writer
from server.media.tracks import AudioSource, sleep_until

log = logging.getLogger(__name__)

#: Frames handed to the encoding thread and not yet written. The track is read without
#: waiting for each frame's encode, since a read that comes late skips the frames it
#: missed (as a late viewer's would); past this backlog the reader waits after all.
ENCODE_BACKLOG = 50


async def record(audio: AudioSource, video: MediaStreamTrack, size: int, path: Path) -> None:
    """Until ``video`` ends (the session closed): each frame it yields, and each audio
    chunk at its send time, into ``path``."""
    clock = audio.clock
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(1, thread_name_prefix="recorder") as thread:
        writer = await loop.run_in_executor(thread, lambda: Mp4Writer(path, size=size,
                                                                       fps=clock.fps))

        async def pictures() -> None:
            pending: deque[asyncio.Future[None]] = deque()
            try:
                while True:
                    frame = await video.recv()
                    pending.append(loop.run_in_executor(thread, writer.video, frame))
                    while pending and (pending[0].done() or len(pending) > ENCODE_BACKLOG):
                        await pending.popleft()
            except MediaStreamError:
                pass
            finally:
                await asyncio.gather(*pending)

        async def sound() -> None:
            k = clock.chunk_index_at(loop.time())
            while not audio.is_closed:
                await sleep_until(clock.audio_send_time(k))
                samples = audio.audio_chunk(k)
                if samples is None:
                    samples = np.zeros(clock.chunk_samples, np.int16)
                await loop.run_in_executor(thread, writer.audio, samples,
                                           clock.audio_pts(k))
                k += 1

        sounds = asyncio.create_task(sound())
        try:
            await pictures()
        finally:
            sounds.cancel()
            await asyncio.gather(sounds, return_exceptions=True)
            await loop.run_in_executor(thread, writer.close)
            log.info("recorded %d frames to %s", writer.frames, path)
