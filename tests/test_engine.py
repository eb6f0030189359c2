"""The shipped sonic-lite ONNX on onnxruntime: real speech in, a talking astronaut out."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import cv2
import numpy as np
import onnx
import pytest

from inference.engine import GEOMETRY_NAMES, KNOB_NAMES, FrameInput, Manifest, PreparedPortrait
from inference.face_geometry import portrait_geometry
from inference.features import FrameWindows, StreamingLogMel
from inference.model.timing import TIMING
from inference.render import render_frames
from inference.runtimes import create_engine
from inference.runtimes.onnxruntime import OnnxRuntimeEngine
from inference.tts import SpeechUnavailable, espeak

pytestmark = pytest.mark.unit

WINDOW = TIMING.window_frames  # mel frames per window, as the engine takes them

REPO = Path(__file__).resolve().parent.parent
MANIFEST = REPO / "engines" / "sonic-lite.json"
AVATAR = REPO / "static" / "avatars" / "astronaut.png"
COEFFICIENTS = (
    "jawOpen", "mouthClose", "mouthFunnel", "mouthPucker", "mouthStretchLeft",
    "mouthStretchRight", "mouthSmileLeft", "mouthSmileRight", "mouthRollLower",
    "mouthPressLeft", "mouthPressRight",
    "eyeBlinkLeft", "eyeBlinkRight", "headPitch", "headYaw", "headRoll",
)
JAW, FUNNEL, STRETCH_L, STRETCH_R = (COEFFICIENTS.index(n) for n in (
    "jawOpen", "mouthFunnel", "mouthStretchLeft", "mouthStretchRight"))
BLINK_L, BLINK_R, PITCH, YAW, ROLL = range(11, 16)

# The astronaut's face, measured by hand in the 512x512 original (pixel centres).
FACE_PX = {
    "mouth": (223.7, 146.0),
    "mouth_half_width": 20.7,
    "chin_y": 178.7,
    "eye_left": (202.5, 101.3),
    "eye_right": (245.6, 103.1),
}
# A square crop around the face with margin, like the server's portrait preparation.
CROP = (29, 127, 224, 322)  # y0, x0, y1, x1


def astronaut(size: int, crop: tuple[int, int, int, int] = CROP) -> PreparedPortrait:
    y0, x0, y1, x1 = crop
    rgb = cv2.cvtColor(cv2.imread(str(AVATAR)), cv2.COLOR_BGR2RGB)
    image = cv2.resize(rgb[y0:y1, x0:x1], (size, size), interpolation=cv2.INTER_AREA)
    image = np.ascontiguousarray(image)
    geometry, _ = portrait_geometry(image)  # face mesh where it runs, the detector's points else
    return PreparedPortrait(image=np.ascontiguousarray(image), geometry=geometry)


def box(portrait: PreparedPortrait, part: str) -> tuple[slice, slice]:
    """Pixel rows/cols of the mouth-to-chin region or the eye band of a prepared portrait."""
    g = dict(zip(GEOMETRY_NAMES, portrait.geometry.tolist(), strict=True))
    size = portrait.size

    def px(n: float) -> int:
        return int(round((n + 1.0) * size / 2.0))

    if part == "mouth":
        mouth_chin = g["chin_y"] - g["mouth_y"]
        rows = slice(px(g["mouth_y"] - 0.4 * mouth_chin), px(g["chin_y"]))
        cols = slice(
            px(g["mouth_x"] - 1.3 * g["mouth_half_width"]),
            px(g["mouth_x"] + 1.3 * g["mouth_half_width"]),
        )
    else:
        eye_dist = g["eye_right_x"] - g["eye_left_x"]
        eye_y = 0.5 * (g["eye_left_y"] + g["eye_right_y"])
        rows = slice(px(eye_y - 0.15 * eye_dist), px(eye_y + 0.15 * eye_dist))
        cols = slice(px(g["eye_left_x"] - 0.4 * eye_dist), px(g["eye_right_x"] + 0.4 * eye_dist))
    return rows, cols


def speak(text: str, voice: str = "en") -> np.ndarray:
    """``text`` spoken by espeak-ng: 16 kHz mono float32 at -20 dBFS (RMS of the voiced
    part), with 0.6 s of digital silence before and after."""
    try:
        samples = espeak(text, voice=voice, words_per_minute=175).astype(np.float32) / 32768.0
    except SpeechUnavailable as exc:
        pytest.skip(str(exc))
    voiced = samples[np.abs(samples) > 1e-3]
    samples = samples * (0.1 / np.sqrt(np.mean(voiced**2)))
    pad = np.zeros(9600, np.float32)
    return np.concatenate([pad, samples.astype(np.float32), pad])


def gain(samples: np.ndarray, db: float) -> np.ndarray:
    return (samples * 10.0 ** (db / 20.0)).astype(np.float32)


def render(
    engine: OnnxRuntimeEngine,
    slot: int,
    samples: np.ndarray,
    knobs: tuple[float, float] = (1.0, 1.0),
    phase: float = 0.0,
    batch: int = 8,
) -> tuple[np.ndarray, np.ndarray]:
    """A frame per 40 ms of ``samples``, cut as a live session cuts them (the offline render)."""
    batches = list(render_frames(engine, slot, samples, batch=batch, phase=phase,
                                 knobs=dict(zip(KNOB_NAMES, knobs, strict=True))))
    return np.concatenate([f for f, _ in batches]), np.concatenate([c for _, c in batches])


def region_diff(frames: np.ndarray, portrait: PreparedPortrait, part: str) -> np.ndarray:
    """Mean absolute pixel difference to the portrait in a region, per frame."""
    rows, cols = box(portrait, part)
    ref = portrait.image[rows, cols].astype(np.float32)
    return np.abs(frames[:, rows, cols].astype(np.float32) - ref).mean(axis=(1, 2, 3))


@pytest.fixture(scope="module")
def engine() -> OnnxRuntimeEngine:
    return OnnxRuntimeEngine(Manifest.load(MANIFEST), intra_op_threads=1)


@pytest.fixture(scope="module")
def p256() -> PreparedPortrait:
    return astronaut(256)


@pytest.fixture(scope="module")
def slot256(engine: OnnxRuntimeEngine, p256: PreparedPortrait) -> int:
    return engine.prepare(p256)


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    return speak("Hello there. My name is Eileen, and I fly the space shuttle.")


def test_manifest_describes_the_shipped_graph() -> None:
    manifest = Manifest.load(MANIFEST)
    assert manifest.name == "sonic-lite" and manifest.fps == 25
    assert manifest.coefficient_names == COEFFICIENTS
    assert manifest.geometry_names == GEOMETRY_NAMES and manifest.knob_names == KNOB_NAMES
    assert (manifest.window_frames, manifest.lookahead_frames) == (WINDOW, 4)
    # frame 0's window ends 8 mel frames in: its own 40 ms and 40 ms of look-ahead
    assert manifest.window_start(0) == 8 - WINDOW and manifest.lookahead_ms == 40.0

    path = Path(manifest.onnx)
    assert path.stat().st_size < 2_000_000
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 17

    def shapes(values: object) -> dict[str, list[str | int]]:
        return {
            v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in values
        }  # type: ignore[attr-defined]

    declared = json.loads(MANIFEST.read_text())
    assert shapes(model.graph.input) == {i["name"]: i["shape"] for i in declared["inputs"]}
    assert shapes(model.graph.output) == {o["name"]: o["shape"] for o in declared["outputs"]}
    assert shapes(model.graph.input)["mel"] == ["batch", WINDOW, 80]
    assert shapes(model.graph.output)["coefficients"] == ["batch", len(COEFFICIENTS)]
    assert manifest.motion_onnx is not None
    motion = onnx.load(manifest.motion_onnx)
    onnx.checker.check_model(motion)
    assert [i.name for i in motion.graph.input] == declared["motion_inputs"]
    assert shapes(motion.graph.input) == {
        i["name"]: i["shape"] for i in declared["inputs"] if i["name"] in declared["motion_inputs"]}
    assert shapes(motion.graph.output) == {"coefficients": ["batch", len(COEFFICIENTS)]}


def test_silence_keeps_the_mouth_closed(
    engine: OnnxRuntimeEngine, slot256: int, p256: PreparedPortrait
) -> None:
    silence = np.zeros(48000, np.float32)
    frames, coeffs = render(engine, slot256, silence, knobs=(1.0, 0.0))
    assert np.abs(coeffs[:, [JAW, STRETCH_L, STRETCH_R, FUNNEL]]).max() < 0.01
    # Without head motion the mouth region is the portrait itself.
    assert region_diff(frames, p256, "mouth").max() < 0.5
    # With head motion the face sways, but the mouth still does not open.
    _, coeffs = render(engine, slot256, silence, knobs=(1.0, 1.0))
    assert coeffs[:, JAW].max() < 0.01
    assert np.abs(coeffs[:, [PITCH, YAW, ROLL]]).max() > 0.002


def test_speech_opens_and_closes_the_mouth(
    engine: OnnxRuntimeEngine, slot256: int, p256: PreparedPortrait, speech: np.ndarray
) -> None:
    frames, coeffs = render(engine, slot256, speech, knobs=(1.0, 0.0))
    jaw = coeffs[:, JAW]
    assert jaw[:8].max() < 0.02 and jaw[-5:].max() < 0.05  # the padding is silence
    assert jaw.max() > 0.6 and jaw.std() > 0.15
    assert 0.15 < np.mean(jaw > 0.3) < 0.85
    # Syllables: the mouth opens wide and closes again many times.
    cycles, is_open = 0, False
    for value in jaw:
        if not is_open and value > 0.5:
            cycles, is_open = cycles + 1, True
        elif is_open and value < 0.25:
            is_open = False
    assert cycles >= 5
    # The pixels follow: open frames differ clearly from the portrait, closed ones do not.
    diff = region_diff(frames, p256, "mouth")
    assert diff[jaw > 0.5].min() > 6.0
    at_rest = coeffs[:, :BLINK_L].max(axis=1) < 0.01  # every mouth shape at rest
    assert at_rest.sum() > 10 and diff[at_rest].max() < 0.5
    assert np.corrcoef(diff, jaw)[0, 1] > 0.8


def test_mouth_slightly_leads_the_sound(
    engine: OnnxRuntimeEngine, slot256: int, speech: np.ndarray
) -> None:
    """jawOpen tracks the loudness envelope best when that is taken 0-60 ms later: the
    training targets open the mouth 40 ms before the sound, as speakers do."""
    _, coeffs = render(engine, slot256, speech, knobs=(1.0, 0.0))
    jaw = coeffs[:, JAW]
    hop = 16000 // 25

    def envelope(shift: int) -> np.ndarray:
        starts = np.clip(np.arange(jaw.size) * hop + shift, 0, speech.size - hop)
        power = np.array([np.mean(speech[s : s + hop] ** 2) for s in starts])
        return np.clip((10.0 * np.log10(power + 1e-10) + 50.0) / 40.0, 0.0, 1.0)

    shifts = np.arange(-1600, 1601, 80)  # -100 ms .. +100 ms in 5 ms steps
    scores = [np.corrcoef(jaw, envelope(int(s)))[0, 1] for s in shifts]
    best_ms = shifts[int(np.argmax(scores))] / 16.0
    assert 0.0 <= best_ms <= 60.0, best_ms
    assert max(scores) > 0.7  # it predicts shapes, not loudness: see the evaluation


def test_motion_scale_zero_freezes_the_mouth(
    engine: OnnxRuntimeEngine, slot256: int, p256: PreparedPortrait, speech: np.ndarray
) -> None:
    frames, coeffs = render(engine, slot256, speech, knobs=(0.0, 0.0))
    assert not coeffs[:, [JAW, STRETCH_L, STRETCH_R, FUNNEL]].any()
    assert region_diff(frames, p256, "mouth").max() < 0.5
    _, natural = render(engine, slot256, speech, knobs=(1.0, 0.0))
    _, doubled = render(engine, slot256, speech, knobs=(2.0, 0.0))
    assert doubled[:, JAW].mean() > 1.3 * natural[:, JAW].mean()


def test_dynamic_scale_sets_head_motion(
    engine: OnnxRuntimeEngine, slot256: int, speech: np.ndarray
) -> None:
    angles = {}
    for scale in (0.0, 1.0, 2.0):
        _, coeffs = render(engine, slot256, speech, knobs=(1.0, scale), phase=321.0)
        angles[scale] = coeffs[:, [PITCH, YAW, ROLL]]
    assert not angles[0.0].any()
    peak = np.abs(angles[1.0]).max()
    assert np.radians(0.3) < peak < np.radians(3.0)
    np.testing.assert_allclose(angles[2.0], 2.0 * angles[1.0], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("level_db", [-30.0, -3.0])
def test_quiet_and_loud_speech_both_animate(
    engine: OnnxRuntimeEngine, slot256: int, speech: np.ndarray, level_db: float
) -> None:
    _, coeffs = render(engine, slot256, gain(speech, level_db + 20.0), knobs=(1.0, 0.0))
    assert coeffs[:, JAW].max() > 0.45 and coeffs[:, JAW].std() > 0.1


def test_background_noise_keeps_the_mouth_closed(engine: OnnxRuntimeEngine, slot256: int) -> None:
    noise = np.random.default_rng(1).normal(0.0, 10 ** (-60 / 20), 48000).astype(np.float32)
    _, coeffs = render(engine, slot256, noise, knobs=(1.0, 0.0))
    assert coeffs[:, [JAW, STRETCH_L, FUNNEL]].max() < 0.05  # visibly closed


@pytest.mark.parametrize(
    "kind", ["clipped", "dc-offset", "full-scale-square", "very-quiet", "full-scale-noise"]
)
def test_hostile_audio_gives_bounded_coefficients(
    engine: OnnxRuntimeEngine, slot256: int, speech: np.ndarray, kind: str
) -> None:
    t = np.arange(48000) / 16000.0
    samples = {
        "clipped": np.clip(speech * 40.0, -1.0, 1.0),
        "dc-offset": speech + 0.6,
        "full-scale-square": np.sign(np.sin(2 * np.pi * 180.0 * t)),
        "very-quiet": gain(speech, -75.0),
        "full-scale-noise": np.random.default_rng(2).uniform(-1.0, 1.0, t.size),
    }[kind].astype(np.float32)
    frames, coeffs = render(engine, slot256, samples, knobs=(2.0, 2.0))
    assert np.isfinite(coeffs).all()
    blendshapes = coeffs[:, :PITCH]
    assert blendshapes.min() >= 0.0 and blendshapes.max() <= 1.0
    assert np.abs(coeffs[:, PITCH:]).max() < np.radians(6.0)
    assert frames.dtype == np.uint8 and frames.shape[1:] == (256, 256, 3)
    if kind == "very-quiet":  # peaks near -75 dBFS: below the silence gate
        assert coeffs[:, JAW].max() < 0.02


def test_non_finite_features_are_survivable(engine: OnnxRuntimeEngine, slot256: int) -> None:
    mel = np.full((WINDOW, 80), -4.0, np.float32)
    mel[3, 5], mel[7, 9], mel[9, 40] = np.nan, np.inf, -np.inf
    out = engine.run(
        [FrameInput(slot256, mel, np.ones(2, np.float32), np.array([1.0, 2.0], np.float32))]
    )
    assert np.isfinite(out.coefficients).all()


def test_blinks_are_irregular_and_differ_between_sessions(
    engine: OnnxRuntimeEngine, slot256: int, p256: PreparedPortrait
) -> None:
    silence = np.zeros(16000 * 30, np.float32)  # 30 s
    manifest = engine.manifest
    onsets = {}
    for phase in (0.0, 517.3):
        windows = FrameWindows(manifest)
        windows.push(silence)
        vector = manifest.knob_vector(dict(zip(KNOB_NAMES, (1.0, 0.0), strict=True)))
        inputs = [FrameInput.for_frame(slot256, i, manifest.fps, mel, vector, phase)
                  for i, mel in [*windows.ready(), *windows.finish()]]
        # The timing from the coefficients alone (the motion graph gives what a render
        # would: test_the_motion_graph_gives_the_rendered_coefficients_of_mixed_sizes).
        coeffs = np.concatenate([engine.run_motion(inputs[i:i + 64])
                                 for i in range(0, len(inputs), 64)])
        blink = coeffs[:, BLINK_L]
        np.testing.assert_array_equal(blink, coeffs[:, BLINK_R])
        closed = blink > 0.9
        onsets[phase] = np.flatnonzero(closed[1:] & ~closed[:-1]) / 25.0
        assert 5 <= onsets[phase].size <= 13, onsets[phase]
        gaps = np.diff(onsets[phase])
        assert gaps.min() > 1.2 and gaps.max() < 7.5 and gaps.std() > 0.3
        # Each blink is short: ~150 ms, i.e. a handful of frames with the lid moving.
        assert np.mean(blink > 0.05) < 0.1
        # The picture: lids down where the coefficients close them, still where they rest.
        shut, rest = np.flatnonzero(closed), np.flatnonzero(blink < 0.01)[::40]
        frames = engine.run([inputs[i] for i in (*shut, *rest)]).frames
        eyes = region_diff(frames, p256, "eyes")
        assert eyes[:shut.size].min() > 5.0 and eyes[shut.size:].max() < 0.5
    assert not np.allclose(onsets[0.0][:3], onsets[517.3][:3], atol=0.2)


def test_batch_of_three_equals_three_single_runs(
    engine: OnnxRuntimeEngine, slot256: int, speech: np.ndarray
) -> None:
    other = engine.prepare(astronaut(256, crop=(0, 0, 512, 512)))
    try:
        features = StreamingLogMel(engine.manifest.features)
        features.push(speech)
        inputs = [
            FrameInput(
                slot256,
                features.window(40, WINDOW),
                np.array([1.0, 1.0], np.float32),
                np.array([1.6, 0.0], np.float32),
            ),
            FrameInput(
                other,
                features.window(64, WINDOW),
                np.array([1.5, 0.5], np.float32),
                np.array([8.2, 77.0], np.float32),
            ),
            FrameInput(
                slot256,
                features.window(-4, WINDOW),
                np.array([0.5, 2.0], np.float32),
                np.array([0.0, 999.9], np.float32),
            ),
        ]
        batched = engine.run(inputs)
        assert batched.frames.shape == (3, 256, 256, 3)
        assert batched.coefficients.shape == (3, len(COEFFICIENTS))
        for k, item in enumerate(inputs):
            single = engine.run([item])
            np.testing.assert_allclose(
                single.coefficients[0], batched.coefficients[k], rtol=0, atol=1e-6
            )
            diff = np.abs(single.frames[0].astype(int) - batched.frames[k].astype(int))
            assert diff.max() <= 1
        assert not np.array_equal(batched.frames[0], batched.frames[1])
    finally:
        engine.release(other)


def test_the_motion_graph_gives_the_rendered_coefficients_of_mixed_sizes(
    engine: OnnxRuntimeEngine, slot256: int, speech: np.ndarray
) -> None:
    """Motion-only sessions' frames skip the renderer: a batch of any portrait sizes gets
    the coefficients rendering would have given, from the shipped motion graph."""
    assert engine.motion_session is not None
    slot512 = engine.prepare(astronaut(512))
    try:
        features = StreamingLogMel(engine.manifest.features)
        features.push(speech)
        inputs = [FrameInput(slot, features.window(start, WINDOW),
                             np.array([scale, 1.0], np.float32),
                             np.array([start / 25, 3.0], np.float32))
                  for slot, start, scale in ((slot256, 40, 1.0), (slot512, 64, 1.5),
                                             (slot256, 120, 0.5), (slot512, -4, 1.0))]
        motion = engine.run_motion(inputs)
        assert motion.shape == (4, len(COEFFICIENTS)) and motion.dtype == np.float32
        for k, item in enumerate(inputs):
            np.testing.assert_allclose(engine.run([item]).coefficients[0], motion[k],
                                       rtol=0, atol=1e-6)
        assert motion[0, 0] != motion[1, 0]  # not one row repeated
    finally:
        engine.release(slot512)


def test_without_a_motion_graph_the_coefficients_come_from_rendering(
    slot256: int, speech: np.ndarray
) -> None:
    """A model that ships no motion graph still serves motion-only sessions."""
    bare = OnnxRuntimeEngine(dataclasses.replace(Manifest.load(MANIFEST), motion_onnx=None))
    slots = [bare.prepare(astronaut(256)), bare.prepare(astronaut(512))]
    features = StreamingLogMel(bare.manifest.features)
    features.push(speech)
    inputs = [FrameInput(slot, features.window(50, WINDOW), np.ones(2, np.float32),
                         np.array([2.0, 0.0], np.float32)) for slot in slots]
    reference = OnnxRuntimeEngine(Manifest.load(MANIFEST))
    np.testing.assert_allclose(bare.run_motion(inputs), reference.run_motion(
        [dataclasses.replace(i, slot=reference.prepare(astronaut(256))) for i in inputs]),
        rtol=0, atol=1e-6)


def test_256_and_512_portraits(engine: OnnxRuntimeEngine, slot256: int, speech: np.ndarray) -> None:
    slot512 = engine.prepare(astronaut(512))
    try:
        assert engine.frame_size(slot256) == 256 and engine.frame_size(slot512) == 512
        frames256, coeffs256 = render(engine, slot256, speech[:32000])
        frames512, coeffs512 = render(engine, slot512, speech[:32000])
        assert frames512.shape[1:] == (512, 512, 3)
        # Audio and clock drive the same motion whatever the resolution ...
        np.testing.assert_allclose(coeffs512, coeffs256, rtol=0, atol=1e-6)
        # ... and the picture is the same up to resampling.
        open_frame = int(np.argmax(coeffs256[:, JAW]))
        small = cv2.resize(frames512[open_frame], (256, 256), interpolation=cv2.INTER_AREA)
        assert np.abs(small.astype(float) - frames256[open_frame]).mean() < 4.0
        mel = np.full((WINDOW, 80), -10.0, np.float32)
        knobs, clock = np.ones(2, np.float32), np.zeros(2, np.float32)
        with pytest.raises(ValueError, match="mixed frame sizes"):
            engine.run(
                [FrameInput(slot256, mel, knobs, clock), FrameInput(slot512, mel, knobs, clock)]
            )
    finally:
        engine.release(slot512)


def test_slot_lifecycle_and_validation(engine: OnnxRuntimeEngine) -> None:
    mel = np.full((WINDOW, 80), -10.0, np.float32)
    knobs, clock = np.ones(2, np.float32), np.zeros(2, np.float32)
    slot = engine.prepare(astronaut(256))
    engine.run([FrameInput(slot, mel, knobs, clock)])
    engine.release(slot)
    engine.release(slot)  # idempotent
    with pytest.raises(KeyError):
        engine.run([FrameInput(slot, mel, knobs, clock)])
    with pytest.raises(KeyError):
        engine.frame_size(slot)
    portrait = astronaut(256)
    with pytest.raises(ValueError):
        engine.prepare(PreparedPortrait(portrait.image[:, :200], portrait.geometry))
    with pytest.raises(ValueError):
        engine.prepare(PreparedPortrait(portrait.image, portrait.geometry[:7]))
    good = engine.prepare(portrait)
    try:
        with pytest.raises(ValueError):
            engine.run([FrameInput(good, mel[:15], knobs, clock)])
        with pytest.raises(ValueError):
            engine.run([])
    finally:
        engine.release(good)


def test_prepare_and_release_while_running(engine: OnnxRuntimeEngine, slot256: int) -> None:
    """The event loop prepares/releases portraits while the worker thread runs batches."""
    portrait = astronaut(256)
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            while not stop.is_set():
                engine.release(engine.prepare(portrait))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        mel = np.full((WINDOW, 80), -10.0, np.float32)
        for i in range(20):
            out = engine.run(
                [
                    FrameInput(
                        slot256, mel, np.ones(2, np.float32), np.array([i / 25.0, 0.0], np.float32)
                    )
                ]
                * 2
            )
            assert out.frames.shape == (2, 256, 256, 3)
    finally:
        stop.set()
        worker.join()
    assert not errors


def test_create_engine_factory() -> None:
    engine = create_engine("onnxruntime", MANIFEST, intra_op_threads=1)
    assert isinstance(engine, OnnxRuntimeEngine) and engine.manifest.name == "sonic-lite"
    assert engine.pixels == "rgb"
    with pytest.raises(ValueError, match="unknown runtime"):
        create_engine("no-such-runtime", MANIFEST)
    with pytest.raises(ValueError, match="pixels='bgr'"):
        create_engine("onnxruntime", MANIFEST, pixels="bgr")


def test_an_engine_made_for_the_encoders_renders_i420_as_opencv_converts(
        engine: OnnxRuntimeEngine, p256: PreparedPortrait, speech: np.ndarray) -> None:
    """The server's frames leave the engine in I420 (Y, then U and V at half the
    resolution each way), exactly what the worker's OpenCV conversion made of RGB."""
    i420 = create_engine("onnxruntime", MANIFEST, intra_op_threads=1, pixels="i420")
    features = StreamingLogMel(engine.manifest.features)
    features.push(speech)
    batch = [FrameInput(0, features.window(start, WINDOW), np.ones(2, np.float32),
                        np.array([start / 25, 0.0], np.float32)) for start in (20, 40, 60)]
    for size, portrait in ((256, p256), (512, astronaut(512))):
        slot = engine.prepare(portrait)
        want = engine.run([dataclasses.replace(f, slot=slot) for f in batch]).frames
        engine.release(slot)
        got = i420.run([dataclasses.replace(f, slot=i420.prepare(portrait)) for f in batch])
        assert got.frames.shape == (3, size * 3 // 2, size)
        for rgb, planes in zip(want, got.frames, strict=True):
            np.testing.assert_array_equal(planes, cv2.cvtColor(rgb, cv2.COLOR_RGB2YUV_I420))
        # The luma plane is the picture: the mouth moves between the frames.
        assert not np.array_equal(got.frames[0, :size], got.frames[2, :size])
    assert i420.run_motion(batch).shape == (3, len(COEFFICIENTS))


@pytest.mark.parametrize(("gpus", "tensorrt", "expected"), [
    (0, False, "onnxruntime"), (0, True, "onnxruntime"),
    (1, False, "torch-cuda"), (1, True, "torch-cuda"),  # never the unverified TensorRT
])
def test_auto_picks_a_verified_runtime(monkeypatch: pytest.MonkeyPatch, gpus: int,
                                       tensorrt: bool, expected: str) -> None:
    import importlib.util

    import inference.runtimes as runtimes

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(runtimes, "cuda_device_count", lambda: gpus)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object()
                        if name == "tensorrt" and tensorrt else find_spec(name, *a))
    assert runtimes.resolve_runtime("auto") == expected
    assert expected in runtimes.VERIFIED and "tensorrt" not in runtimes.VERIFIED
    assert runtimes.resolve_runtime("tensorrt") == "tensorrt"  # still there when named


def test_torch_module_matches_onnx(
    engine: OnnxRuntimeEngine, slot256: int, p256: PreparedPortrait, speech: np.ndarray
) -> None:
    """The torch definition (for GPU runtimes) and the shipped ONNX agree."""
    torch = pytest.importorskip("torch")
    from inference.model.export import build_model

    features = StreamingLogMel(engine.manifest.features)
    features.push(speech)
    starts = range(-4, features.frames_available - WINDOW, 9)
    mel = np.stack([features.window(s, WINDOW) for s in starts])
    n = mel.shape[0]
    knobs = np.tile(np.array([[1.2, 1.5]], np.float32), (n, 1))
    clock = np.stack([np.arange(n) * 0.37, np.full(n, 42.0)], axis=1).astype(np.float32)
    out = engine.run([FrameInput(slot256, mel[i], knobs[i], clock[i]) for i in range(n)])
    portrait = np.repeat((p256.image.astype(np.float32) / 255.0).transpose(2, 0, 1)[None], n, 0)
    with torch.no_grad():
        frames, coeffs = build_model()(
            torch.from_numpy(mel),
            torch.from_numpy(portrait),
            torch.from_numpy(np.repeat(p256.geometry[None], n, 0)),
            torch.from_numpy(knobs),
            torch.from_numpy(clock),
        )
    np.testing.assert_allclose(coeffs.numpy(), out.coefficients, rtol=0, atol=1e-5)
    diff = np.abs(frames.numpy().astype(int) - out.frames.astype(int))
    assert diff.max() <= 2 and diff.mean() < 0.01


def test_export_reproduces_the_shipped_onnx(tmp_path: Path) -> None:
    """A stale engines/ ONNX (model edited, not re-exported) fails here."""
    torch = pytest.importorskip("torch")
    from inference.model.export import export

    shipped = json.loads(MANIFEST.read_text())
    if shipped.get("exported_with", {}).get("torch") != torch.__version__:
        pytest.skip(f"shipped ONNX was exported with torch {shipped.get('exported_with')}")
    onnx_path, motion_path, json_path = export(tmp_path)
    assert onnx_path.read_bytes() == (MANIFEST.parent / shipped["onnx"]).read_bytes()
    assert motion_path.read_bytes() == (MANIFEST.parent / shipped["motion_onnx"]).read_bytes()
    assert json_path.read_text() == MANIFEST.read_text()
