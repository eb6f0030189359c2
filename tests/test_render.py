"""Offline render: one portrait and one WAV in, an MP4 with video and audio out."""

from __future__ import annotations

import av
import cv2
import numpy as np
import pytest

from inference.render import main
from inference.tts import SpeechUnavailable, espeak, silence, write_wav


@pytest.fixture(scope="module")
def short_wav(tmp_path_factory):
    try:
        pcm = np.concatenate([silence(0.4), espeak("Open wide, say ah."), silence(0.4)])
    except SpeechUnavailable as exc:
        pytest.skip(str(exc))
    return write_wav(tmp_path_factory.mktemp("render") / "short.wav", pcm), len(pcm) / 16000


def test_render_writes_a_talking_mp4_with_audio(short_wav, tmp_path, capsys):
    wav, seconds = short_wav
    out = tmp_path / "talking.mp4"
    assert main(["--audio", str(wav), "--out", str(out), "--size", "256"]) == 0
    with av.open(str(out)) as container:
        video = container.streams.video[0]
        audio = container.streams.audio[0]
        assert (video.width, video.height) == (256, 256)
        assert audio.rate == 48000
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert abs(len(frames) - seconds * 25) <= 2
    first = frames[0].astype(np.float32)
    change = [np.abs(f.astype(np.float32) - first).mean() for f in frames]
    assert max(change) > 1.0  # the face moved while speaking
    assert f"wrote {len(frames)} frames" in capsys.readouterr().out


def test_render_refuses_a_portrait_without_a_face(short_wav, tmp_path, capsys):
    wav, _ = short_wav
    grey = tmp_path / "grey.png"
    cv2.imwrite(str(grey), np.full((256, 256, 3), 128, np.uint8))
    assert main(["--audio", str(wav), "--image", str(grey), "--out",
                 str(tmp_path / "x.mp4")]) == 2
    assert "face" in capsys.readouterr().err
