"""The tuned encoders: what the VP8 one sends decodes to the frame it was given, and every
VP8 sender of the process uses it once installed; the speech Opus one decodes back to the
speech, one packet per chunk on the chunk's own timestamp, and packets joined decode to
the same sound as the packets one by one."""

from __future__ import annotations

import asyncio
import fractions
import threading

import aiortc.rtcrtpsender
import av
import cv2
import numpy as np
import pytest
from aiortc.codecs import get_capabilities, vpx

from inference.images import load_default_avatar
from inference.portrait import prepare_portrait
from inference.tts import SpeechUnavailable, conversation
from server.media.encoding import (
    EncodeBatches,
    RealtimeVp8Encoder,
    SpeechOpusEncoder,
    Vp8Tuning,
    join_opus,
    use_realtime_vp8,
)

pytestmark = pytest.mark.unit


def _frames(count: int) -> list[np.ndarray]:
    image = prepare_portrait(load_default_avatar(), size=256).image
    return [np.roll(image, int(3 * np.sin(i / 4)), axis=0).copy() for i in range(count)]


def _round_trip(encoder: RealtimeVp8Encoder, frames: list[np.ndarray]
                ) -> tuple[list[np.ndarray], int]:
    """What a viewer decodes of ``frames``, and the bytes it was sent."""
    decoder = av.CodecContext.create("libvpx", "r")
    decoded, sent = [], 0
    for i, rgb in enumerate(frames):
        frame = av.VideoFrame.from_ndarray(cv2.cvtColor(rgb, cv2.COLOR_RGB2YUV_I420),
                                           format="yuv420p")
        frame.pts, frame.time_base = i, fractions.Fraction(1, 25)
        payloads, timestamp = encoder.encode(frame, force_keyframe=i == 0)
        assert payloads and timestamp == i * 3600
        data = b"".join(vpx.vp8_depayload(p) for p in payloads)
        sent += len(data)
        decoded += [f.to_ndarray(format="rgb24") for f in decoder.decode(av.Packet(data))]
    assert len(decoded) == len(frames)
    return decoded, sent


def _psnr(decoded: list[np.ndarray], frames: list[np.ndarray]) -> float:
    error = np.mean([(d.astype(float) - f) ** 2 for d, f in zip(decoded, frames, strict=True)])
    return float(10 * np.log10(255**2 / error))


def test_the_stream_decodes_to_the_frames_it_was_given():
    frames = _frames(30)
    decoded, _ = _round_trip(RealtimeVp8Encoder(), frames)
    assert _psnr(decoded[5:], frames[5:]) > 33  # dB, at aiortc's starting 500 kbps


def test_a_still_portrait_is_not_coded_again_but_its_moving_mouth_is():
    """The static threshold: a still face whose mouth patch changes every frame costs far
    fewer bits than with every macroblock coded, and the mouth decodes as well."""
    image = prepare_portrait(load_default_avatar(), size=256).image
    rng = np.random.default_rng(3)
    ys, xs = slice(150, 182), slice(96, 160)
    frames = []
    for i in range(40):
        frame = (image.astype(np.int16) + rng.integers(-1, 2, image.shape)).clip(0, 255)
        frame[ys, xs] = (image[ys, xs].astype(np.int16) + int(40 * np.sin(i / 3))).clip(0, 255)
        frames.append(frame.astype(np.uint8))
    still, still_sent = _round_trip(RealtimeVp8Encoder(Vp8Tuning(static_threshold=500)), frames)
    every, every_sent = _round_trip(RealtimeVp8Encoder(Vp8Tuning(static_threshold=0)), frames)
    assert still_sent < 0.8 * every_sent
    mouth = [f[ys, xs] for f in frames[5:]]
    assert _psnr([d[ys, xs] for d in still[5:]], mouth) > \
        _psnr([d[ys, xs] for d in every[5:]], mouth) - 1.0
    assert _psnr(still[5:], frames[5:]) > 33


def test_installed_it_serves_vp8_and_leaves_other_codecs_alone():
    original = aiortc.rtcrtpsender.get_encoder
    try:
        use_realtime_vp8(Vp8Tuning(speed=16))
        use_realtime_vp8(Vp8Tuning(speed=12))  # installing twice wraps aiortc's factory once
        codecs = {c.mimeType: c for c in get_capabilities("video").codecs}
        vp8 = aiortc.rtcrtpsender.get_encoder(codecs["video/VP8"])
        assert isinstance(vp8, RealtimeVp8Encoder) and vp8.tuning.speed == 12
        h264 = aiortc.rtcrtpsender.get_encoder(codecs["video/H264"])
        assert not isinstance(h264, RealtimeVp8Encoder)
    finally:
        aiortc.rtcrtpsender.get_encoder = original


def test_speech_opus_packets_decode_to_the_speech_on_the_chunks_timestamps():
    try:
        speech = conversation(48000).astype(np.int16)
    except SpeechUnavailable as exc:
        pytest.skip(str(exc))
    encoder = SpeechOpusEncoder()
    decoder = av.CodecContext.create("libopus", "r")
    chunks = [speech[i:i + 960] for i in range(0, len(speech) - 960, 960)]
    decoded = []
    for k, chunk in enumerate(chunks):
        pts = 960 * (k + 7)  # a track that started at chunk 7
        packet = encoder.encode(chunk, pts)
        assert packet.pts == pts and 0 < packet.size < 4 * 64000 // 8 // 50
        for out in decoder.decode(packet):
            decoded.append(out.to_ndarray().reshape(-1, len(out.layout.channels))[:, 0])
    got = np.concatenate(decoded).astype(float)
    sent = np.concatenate(chunks).astype(float)
    n = len(sent) - 400
    lag = int(np.argmax([np.dot(got[d:d + n], sent[:n]) for d in range(400)]))  # codec delay
    assert np.corrcoef(got[lag:lag + n], sent[:n])[0, 1] > 0.95


def _speech_packets(count: int) -> list[av.Packet]:
    t = np.arange(960 * count) / 48000
    voice = 6000 * np.sin(2 * np.pi * 180 * t) * (1 + np.sin(2 * np.pi * 3 * t))
    noise = np.random.default_rng(0).normal(0, 300, t.size)
    speech = (voice + noise).astype(np.int16)
    encoder = SpeechOpusEncoder()
    return [encoder.encode(speech[960 * k:960 * (k + 1)], 960 * k) for k in range(count)]


def _decoded(packets: list[av.Packet]) -> np.ndarray:
    decoder = av.CodecContext.create("libopus", "r")
    decoder.format, decoder.layout, decoder.sample_rate = "s16", "mono", 48000
    return np.concatenate([f.to_ndarray().reshape(-1) for p in packets
                           for f in decoder.decode(p)])


@pytest.mark.parametrize("per_packet", [2, 3])
def test_joined_opus_packets_decode_to_the_same_sound_as_the_frames_one_by_one(per_packet):
    packets = _speech_packets(12)
    joined = [join_opus(packets[i:i + per_packet]) for i in range(0, 12, per_packet)]
    assert all(j is not None for j in joined)
    assert [j.pts for j in joined] == [p.pts for p in packets[::per_packet]]  # type: ignore[union-attr]
    one_by_one, together = _decoded(packets), _decoded(joined)  # type: ignore[arg-type]
    assert together.size == one_by_one.size == 12 * 960
    assert np.array_equal(together, one_by_one) and np.abs(together).max() > 3000


def test_opus_packets_of_other_modes_or_several_frames_are_not_joined():
    a, b, c = _speech_packets(3)
    other_mode = av.Packet(bytes([bytes(b)[0] ^ 0x80]) + bytes(b)[1:])  # another config
    assert join_opus([a, other_mode]) is None
    assert join_opus([join_opus([a, b]), c]) is None  # type: ignore[list-item]
    assert join_opus([a]) is None and join_opus([a, av.Packet(b"")]) is None
    assert join_opus([a] * 6) is not None and join_opus([a] * 7) is None  # 120 ms at most


async def test_encodes_asked_in_one_turn_of_the_loop_go_to_threads_a_batch_at_a_time():
    class Recorded(RealtimeVp8Encoder):
        thread = 0

        def compress(self, frame: av.VideoFrame, force_keyframe: bool = False) -> bytes:
            self.thread = threading.get_ident()
            if frame.width == 32:
                raise ValueError("not this one")
            return super().compress(frame, force_keyframe)

    def picture(side: int) -> av.VideoFrame:
        frame = av.VideoFrame.from_ndarray(np.zeros((side, side, 3), np.uint8), format="rgb24")
        frame.pts, frame.time_base = 0, fractions.Fraction(1, 25)
        return frame

    encodes = EncodeBatches(per_hand_off=4)
    encoders = [Recorded() for _ in range(6)]
    asked = [encodes.compress(e, picture(32 if i == 2 else 64), True)
             for i, e in enumerate(encoders)]
    asked[5].cancel()  # its session stopped waiting: the others are still answered
    done = await asyncio.gather(*asked[:5], return_exceptions=True)
    encodes.close()
    assert isinstance(done[2], ValueError) and asked[5].cancelled()
    for data in (d for i, d in enumerate(done) if i != 2):
        decoder = av.CodecContext.create("libvpx", "r")
        (frame,) = decoder.decode(av.Packet(data))
        assert (frame.width, frame.height) == (64, 64)
    threads = [e.thread for e in encoders]  # four encoded on one thread, two on another
    assert 0 not in threads and len(set(threads[:4])) == 1 and len(set(threads[4:])) == 1


def test_libopus_refusing_a_frame_names_the_call_and_its_reason():
    from server.media.opus import OpusEncoder, OpusError

    with pytest.raises(OpusError, match="opus_encode of 1000 samples: invalid argument"):
        OpusEncoder().encode(np.zeros(1000, np.int16))  # not 2.5, 5, 10, 20, 40 or 60 ms


def _conversation_chunks() -> list[np.ndarray]:
    try:
        speech = conversation(48000).astype(np.int16)
    except SpeechUnavailable as exc:
        pytest.skip(str(exc))
    return [speech[i:i + 960] for i in range(0, len(speech) - 960, 960)]


def _snr(sent: np.ndarray, got: np.ndarray) -> float:
    sent, got = sent.astype(float), got.astype(float)
    return float(10 * np.log10(np.sum(sent ** 2) / np.sum((sent - got) ** 2)))


def test_speech_coded_by_libopus_itself_is_ffmpegs_coding_byte_for_byte():
    chunks = _conversation_chunks()
    rng = np.random.default_rng(0)
    chunks = [c + rng.integers(-1, 2, c.size).astype(np.int16) for c in chunks]  # no silence
    ours = SpeechOpusEncoder()
    ffmpeg = av.CodecContext.create("libopus", "w")
    ffmpeg.bit_rate, ffmpeg.format, ffmpeg.layout, ffmpeg.sample_rate = 64000, "s16", "mono", 48000
    ffmpeg.time_base = fractions.Fraction(1, 48000)
    ffmpeg.options = {"application": "lowdelay", "compression_level": "5"}
    for k, chunk in enumerate(chunks):
        frame = av.AudioFrame.from_ndarray(chunk.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts = 48000, 960 * k
        [theirs] = ffmpeg.encode(frame)
        assert bytes(ours.encode(chunk, 960 * k)) == bytes(theirs)


def test_settled_silence_is_sent_again_without_the_encoder_and_decodes_as_if_coded():
    from server.media.opus import OpusEncoder

    chunks = _conversation_chunks()
    encoder = SpeechOpusEncoder()
    calls = []
    encode = encoder._encoder.encode
    encoder._encoder.encode = lambda samples: calls.append(1) or encode(samples)  # type: ignore[method-assign]
    sent = [encoder.encode(c, 960 * k) for k, c in enumerate(chunks)]
    everything = OpusEncoder()
    coded = [av.Packet(everything.encode(c)) for c in chunks]
    silent = [not c.any() for c in chunks]
    assert sum(silent) > 100 and len(calls) < len(chunks) - 0.8 * sum(silent)
    assert {bytes(p) for p, s in zip(sent, silent, strict=True) if s} >= {b"\xf8\xff\xfe"}
    assert [p.pts for p in sent] == [960 * k for k in range(len(chunks))]
    speech, lag = np.concatenate(chunks), 120  # the codec's delay
    ours, theirs = _decoded(sent)[lag:], _decoded(coded)[lag:]
    n = ours.size
    assert abs(_snr(speech[:n], ours) - _snr(speech[:n], theirs)) < 0.2
    for k in [k for k in range(1, len(chunks) - 3) if silent[k - 1] and not silent[k]]:
        onset = slice(960 * k, 960 * (k + 3))  # the 60 ms after each pause
        assert _snr(speech[onset], ours[onset]) > _snr(speech[onset], theirs[onset]) - 2.0
