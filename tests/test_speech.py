"""Pushed speech: decoded as it streams in, whatever the pieces; queued with
backpressure; a barge-in lets a waiting producer go."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from inference.tts import wav_bytes
from server.media.speech import SpeechDecoder, SpeechError, SpeechQueue

pytestmark = pytest.mark.unit


def _decode(content_type: str, data: bytes, piece: int) -> np.ndarray:
    decoder = SpeechDecoder(content_type)
    out = [decoder.feed(data[i:i + piece]) for i in range(0, len(data), piece)]
    decoder.finish()
    return np.concatenate(out)


def test_a_wav_decodes_the_same_however_it_is_cut_into_pieces():
    pcm = (np.sin(np.arange(4800) / 7) * 8000).astype(np.int16)
    whole = _decode("audio/wav", wav_bytes(pcm, 48000), 1 << 20)
    assert np.array_equal(whole, pcm)  # 48 kHz mono passes through untouched
    for piece in (1, 3, 45, 1000):
        assert np.array_equal(_decode("audio/wav", wav_bytes(pcm, 48000), piece), whole)


def test_l16_is_big_endian_and_is_resampled_to_48k():
    pcm = (np.sin(np.arange(1600) / 5) * 8000).astype(np.int16)
    out = _decode("audio/L16; rate=16000", pcm.astype(">i2").tobytes(), 333)
    assert abs(out.size - 4800) < 64 and np.abs(out).max() > 6000
    with pytest.raises(SpeechError) as info:
        _decode("audio/L16;rate=16000;channels=2", b"\x00" * 6, 6)
    assert info.value.code == "odd_byte_count"


async def test_a_producer_ahead_of_real_time_waits_and_a_barge_in_lets_it_go():
    queue = SpeechQueue(chunk=960, limit=4 * 960)
    producer = asyncio.create_task(queue.put(np.ones(10 * 960, np.int16), "u1", 0))
    await asyncio.sleep(0.05)
    assert not producer.done() and queue.queued == 4 * 960  # bounded: it waits
    chunk, sources = queue.read()
    assert chunk.size == 960 and sources == [("u1", 960)]
    await asyncio.sleep(0.05)
    assert queue.queued == 4 * 960 and not producer.done()  # one more came in
    assert queue.clear() == ["u1"]
    assert await asyncio.wait_for(producer, 1) is False  # let go, nothing more queued
    assert queue.queued == 0 and queue.read() is None
