"""Offline render: one portrait and one WAV in, an MP4 with video and audio out."""

from __future__ import annotations

import av
import cv2
import numpy as np
import pytest

from inference.render import main
from inference.tts import SpeechUnavailable, espeak, silence, write_wav

pytestmark = pytest.mark.unit


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
    assert len(frames) == int(np.ceil(seconds * 25))  # a frame for every 40 ms begun
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


def test_render_refuses_a_size_the_model_was_not_made_for(short_wav, tmp_path, capsys):
    wav, _ = short_wav
    with pytest.raises(SystemExit) as exit_:
        main(["--audio", str(wav), "--out", str(tmp_path / "x.mp4"), "--size", "300"])
    assert exit_.value.code == 2
    assert "--size 300: sonic-lite is made for 256, 512" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--audio", str(wav), "--out", str(tmp_path / "x.mp4"), "--motion-scale", "5"])
    assert "--motion-scale 5 must be in [0, 2]" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "content", "said"), [
    ("missing.png", None, "No such file or directory"),
    ("notes.txt", b"not a picture", "This is not an image; use a JPEG or PNG."),
])
def test_render_names_the_bad_image_argument(short_wav, tmp_path, capsys, name, content, said):
    wav, _ = short_wav
    image = tmp_path / name
    if content is not None:
        image.write_bytes(content)
    assert main(["--audio", str(wav), "--image", str(image), "--out",
                 str(tmp_path / "x.mp4")]) == 2
    assert f"--image {image}: {said}" in capsys.readouterr().err
    assert not (tmp_path / "x.mp4").exists()


def test_render_names_the_bad_audio_argument(tmp_path, capsys):
    missing = tmp_path / "missing.wav"
    assert main(["--audio", str(missing), "--out", str(tmp_path / "x.mp4")]) == 2
    assert f"--audio {missing}: No such file or directory" in capsys.readouterr().err
