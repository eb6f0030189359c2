"""The tuned VP8 encoder: what it sends decodes to the frame it was given, and every VP8
sender of the process uses it once installed."""

from __future__ import annotations

import fractions

import aiortc.rtcrtpsender
import av
import cv2
import numpy as np
from aiortc.codecs import get_capabilities, vpx

from inference.images import load_default_avatar
from inference.portrait import prepare_portrait
from server.encoding import RealtimeVp8Encoder, use_realtime_vp8


def _frames(count: int) -> list[np.ndarray]:
    image = prepare_portrait(load_default_avatar(), size=256).image
    return [np.roll(image, int(3 * np.sin(i / 4)), axis=0).copy() for i in range(count)]


def test_the_stream_decodes_to_the_frames_it_was_given():
    encoder = RealtimeVp8Encoder(speed=12)
    decoder = av.CodecContext.create("libvpx", "r")
    frames = _frames(30)
    decoded = []
    for i, rgb in enumerate(frames):
        frame = av.VideoFrame.from_ndarray(cv2.cvtColor(rgb, cv2.COLOR_RGB2YUV_I420),
                                           format="yuv420p")
        frame.pts, frame.time_base = i, fractions.Fraction(1, 25)
        payloads, timestamp = encoder.encode(frame, force_keyframe=i == 0)
        assert payloads and timestamp == i * 3600
        data = b"".join(vpx.vp8_depayload(p) for p in payloads)
        decoded += [f.to_ndarray(format="rgb24") for f in decoder.decode(av.Packet(data))]
    assert len(decoded) == len(frames)
    error = np.mean([(d.astype(float) - f) ** 2 for d, f in zip(decoded[5:], frames[5:],
                                                                 strict=True)])
    assert 10 * np.log10(255**2 / error) > 33  # dB, at aiortc's starting 500 kbps


def test_installed_it_serves_vp8_and_leaves_other_codecs_alone():
    original = aiortc.rtcrtpsender.get_encoder
    try:
        use_realtime_vp8(16)
        use_realtime_vp8(12)  # installing twice wraps aiortc's factory once
        codecs = {c.mimeType: c for c in get_capabilities("video").codecs}
        vp8 = aiortc.rtcrtpsender.get_encoder(codecs["video/VP8"])
        assert isinstance(vp8, RealtimeVp8Encoder) and vp8.speed == 12
        h264 = aiortc.rtcrtpsender.get_encoder(codecs["video/H264"])
        assert not isinstance(h264, RealtimeVp8Encoder)
    finally:
        aiortc.rtcrtpsender.get_encoder = original
