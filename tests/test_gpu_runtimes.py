"""GPU runtimes against the ONNX reference: same frames within a stated tolerance.

Tolerances (grey levels of uint8 frames; coefficients absolute). A hard edge in the
renderer (the mouth cavity's rim) can flip a few pixels by more than a few grey levels
when a coefficient moves by 1e-4, so besides max and mean we bound the share of outliers:

* torch FP32 (CPU or CUDA) vs onnxruntime: mean <= 0.05, at most 0.01 % of values off by
  more than 2, none by more than 16; coefficients <= 5e-4 (cuDNN and onnxruntime sum the
  audio head's convolutions in different orders).
* torch-cuda ``fp16`` (FP16 portrait bank, FP32 math) and ``amp`` (autocast FP16 math,
  non-finite rows redone in FP32) vs onnxruntime: mean <= 1, at most 0.01 % of values off
  by more than 8, none by more than 32; coefficients <= 1e-2 (the motion graph under
  ``fp16``: 2e-3, since cuDNN may run its convolutions in TF32, PyTorch's default; the
  audio head, made dense on CUDA, was off by up to 6.8e-4 on an H100).
* padding a batch to a captured size, or splitting it into chunks: max 1, mean 0.01
  (kernels may sum in another order per batch size); coefficients to 1e-6 on the CPU and
  1e-5 on CUDA.

The CPU path of the torch runtime always runs here. CUDA tests skip without a GPU and
TensorRT tests skip where TensorRT does not import. Inputs are real espeak-ng speech at
several levels, mixed with noise, plus noise alone and silence; without espeak-ng the
speech is read from ``.gpudata/speech.npy`` (written by ``python -m benchmarks.gpu
--save-data .gpudata``), and a missing face detector falls back to the prepared portraits
saved there.
"""

from __future__ import annotations

import gc
import importlib.util
import threading
import weakref
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from inference.engine import FrameInput, Manifest, PreparedPortrait
from inference.pixels import rgb_to_i420
from inference.runtimes.onnxruntime import OnnxRuntimeEngine

REPO = Path(__file__).resolve().parent.parent
MANIFEST_PATH = REPO / "engines" / "sonic-lite.json"
DATA = REPO / ".gpudata"


def _cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


torch = pytest.importorskip("torch", reason="the torch runtime needs PyTorch (dev extra)")
needs_cuda = pytest.mark.skipif(not _cuda(), reason="no CUDA device visible to torch")


@cache
def manifest() -> Manifest:
    return Manifest.load(MANIFEST_PATH)


@cache
def speech() -> np.ndarray:
    from inference.tts import SpeechUnavailable, conversation

    try:
        return conversation().astype(np.float32) / 32768
    except SpeechUnavailable:
        if (DATA / "speech.npy").exists():
            return np.load(DATA / "speech.npy").astype(np.float32) / 32768
        pytest.skip("no espeak-ng and no .gpudata/speech.npy")


@cache
def portrait(size: int, mirrored: bool = False) -> PreparedPortrait:
    try:
        from inference.images import load_default_avatar
        from inference.portrait import prepare_portrait

        p = prepare_portrait(load_default_avatar(), size=size)
    except Exception:  # e.g. no ai-edge-litert for the face detector
        if not (DATA / f"portrait_{size}.npy").exists():
            pytest.skip(f"no face detector and no .gpudata/portrait_{size}.npy")
        p = PreparedPortrait(np.load(DATA / f"portrait_{size}.npy"),
                             np.load(DATA / f"geometry_{size}.npy"))
    if not mirrored:
        return p
    # Another person, as far as the engine can tell: mirrored, tinted, geometry mirrored.
    image = np.ascontiguousarray(p.image[:, ::-1, ::-1])
    geometry = p.geometry.copy()
    names = manifest().geometry_names
    for i, name in enumerate(names):
        if name.endswith("_x"):
            geometry[i] = -geometry[i]
    left, right = names.index("eye_left_x"), names.index("eye_right_x")
    geometry[[left, left + 1, right, right + 1]] = geometry[[right, right + 1, left, left + 1]]
    return PreparedPortrait(image, geometry)


@cache
def windows() -> np.ndarray:
    """Mel windows from speech at -26, -6 and 0 dB gain, speech in noise, noise, silence."""
    from inference.features import log_mel

    m = manifest()
    clean = speech()
    rng = np.random.default_rng(4)
    signals = [clean * 0.05, clean * 0.5, np.clip(clean * 4.0, -1.0, 1.0),
               clean * 0.5 + rng.normal(0, 0.02, clean.shape).astype(np.float32),
               rng.normal(0, 0.05, clean.shape).astype(np.float32),
               np.zeros(16000, np.float32)]
    out = []
    for signal in signals:
        mel = log_mel(signal, m.features)
        loud = np.argsort(mel.mean(axis=1))[::-1]  # the most speech-like windows first
        for start in np.clip(loud[:: max(1, len(loud) // 6)][:3] - 8, 0,
                             len(mel) - m.window_frames):
            out.append(mel[start : start + m.window_frames])
    return np.stack(out).astype(np.float32)


def frames(slots: list[int], count: int, offset: int = 0) -> list[FrameInput]:
    w = windows()
    return [FrameInput(slot=slots[i % len(slots)], mel=w[(i + offset) % len(w)],
                       knobs=np.array([0.5 + 0.25 * (i % 5), (i % 3) * 0.8], np.float32),
                       clock=np.array([0.9 * i + 2.7, 0.31 * i], np.float32))
            for i in range(count)]


def reference(size: int, count: int, offset: int = 0):  # type: ignore[no-untyped-def]
    engine = OnnxRuntimeEngine(manifest())
    slot = engine.prepare(portrait(size))
    return engine.run(frames([slot], count, offset))


def assert_close(a: np.ndarray, b: np.ndarray, max_grey: int, mean_grey: float,
                 outlier_grey: int | None = None, outlier_share: float = 1e-4) -> None:
    """|a - b| within max and mean; with ``outlier_grey``, at most ``outlier_share`` of the
    values may exceed it (and ``max_grey`` is the hard cap)."""
    d = np.abs(a.astype(np.int16) - b.astype(np.int16))
    share = float((d > outlier_grey).mean()) if outlier_grey is not None else 0.0
    stats = (int(d.max()), float(d.mean()), share)
    assert d.max() <= max_grey and d.mean() <= mean_grey and share <= outlier_share, stats


def torch_engine(**opts):  # type: ignore[no-untyped-def]
    from inference.runtimes.torch_cuda import TorchCudaEngine

    return TorchCudaEngine(manifest(), **opts)


# ---------------------------------------------------------------------- CPU path
@pytest.mark.unit
def test_torch_cpu_matches_onnxruntime() -> None:
    ref = reference(256, 8)
    engine = torch_engine(device="cpu")
    slot = engine.prepare(portrait(256))
    out = engine.run(frames([slot], 8))
    assert out.frames.shape == ref.frames.shape and out.frames.dtype == np.uint8
    assert_close(out.frames, ref.frames, 16, 0.05, outlier_grey=2)
    np.testing.assert_allclose(out.coefficients, ref.coefficients, atol=5e-4)


@pytest.mark.unit
def test_torch_cpu_padding_and_chunks_change_nothing() -> None:
    engine = torch_engine(device="cpu", batch_sizes=(1, 2, 4), max_chunk=2)
    slot = engine.prepare(portrait(256))
    batch = frames([slot], 3)  # chunks of 2 and 1 (no padding) ...
    alone = [engine.run([item]) for item in batch]
    chunked = engine.run(batch)
    padded = torch_engine(device="cpu", batch_sizes=(1, 4))  # ... and 3 padded to 4
    slot_p = padded.prepare(portrait(256))
    padded_out = padded.run(frames([slot_p], 3))
    for i, single in enumerate(alone):
        assert_close(chunked.frames[i], single.frames[0], 1, 0.01)
        assert_close(padded_out.frames[i], single.frames[0], 1, 0.01)
        np.testing.assert_allclose(padded_out.coefficients[i], single.coefficients[0], atol=1e-6)


def _check_isolation(engine) -> None:  # type: ignore[no-untyped-def]
    a = engine.prepare(portrait(256))
    b = engine.prepare(portrait(256, mirrored=True))
    mixed = engine.run(frames([a, b], 4))
    only_a = engine.run(frames([a], 4))
    only_b = engine.run(frames([b], 4))
    assert not np.array_equal(mixed.frames[0], mixed.frames[1])
    for i in range(4):
        want = (only_a if i % 2 == 0 else only_b).frames[i]
        assert_close(mixed.frames[i], want, 1, 0.01)
    # A released row is reused by the next portrait; the other slot is untouched.
    engine.release(a)
    with pytest.raises(KeyError):
        engine.run(frames([a], 1))
    c = engine.prepare(portrait(256, mirrored=True))
    after = engine.run(frames([c, b], 4))
    for i in range(4):
        assert_close(after.frames[i], only_b.frames[i], 1, 0.01)
    engine.release(b)
    engine.release(b)  # twice is a no-op
    engine.release(c)


@pytest.mark.unit
def test_torch_cpu_slots_are_isolated() -> None:
    _check_isolation(torch_engine(device="cpu"))


@pytest.mark.unit
def test_torch_cpu_rejects_bad_input() -> None:
    engine = torch_engine(device="cpu")
    slot = engine.prepare(portrait(256))
    other = engine.prepare(PreparedPortrait(np.zeros((64, 64, 3), np.uint8),
                                            portrait(256).geometry))
    with pytest.raises(ValueError, match="mixed frame sizes"):
        engine.run(frames([slot, other], 2))
    with pytest.raises(ValueError, match="mel window"):
        engine.run([FrameInput(slot, np.zeros((3, 80), np.float32), np.ones(2, np.float32),
                               np.zeros(2, np.float32))])
    with pytest.raises(ValueError, match="empty"):
        engine.run([])
    with pytest.raises(ValueError, match="geometry"):
        engine.prepare(PreparedPortrait(np.zeros((64, 64, 3), np.uint8), np.zeros(3, np.float32)))


@pytest.mark.unit
def test_bank_grows_and_release_during_a_batch_is_deferred() -> None:
    engine = torch_engine(device="cpu", initial_slots=2)
    slots = [engine.prepare(portrait(256)) for _ in range(2)]
    first = engine.run(frames(slots, 2))
    more = [engine.prepare(portrait(256, mirrored=True)) for _ in range(3)]  # grows 2 -> 4 -> 8
    again = engine.run(frames(slots, 2))
    np.testing.assert_array_equal(first.frames, again.frames)

    # Release a slot from another thread while its batch runs: its row must not be handed
    # to a new portrait before the batch ends.
    started, proceed = threading.Event(), threading.Event()
    original = engine._forward

    def slow_forward(*args, **kwargs):  # type: ignore[no-untyped-def]
        started.set()
        proceed.wait(5)
        return original(*args, **kwargs)

    engine._forward = slow_forward  # type: ignore[method-assign]
    result: dict[str, object] = {}
    worker = threading.Thread(target=lambda: result.update(out=engine.run(frames([more[0]], 1))))
    worker.start()
    assert started.wait(5)
    engine.release(more[0])
    row_of_released = 2  # more[0] took the first row of the grown bank
    newcomer = engine.prepare(portrait(256))
    assert engine._slots[newcomer].row != row_of_released
    proceed.set()
    worker.join(10)
    engine._forward = original  # type: ignore[method-assign]
    assert (256, row_of_released) not in engine._in_use
    assert row_of_released in engine._banks[256].free


def assert_i420_of(i420: np.ndarray, rgb: np.ndarray) -> None:
    """Frames made in I420 are OpenCV's conversion of the same frames made in RGB, to
    within a level of rounding (what the server's encoders were fed before)."""
    want = rgb_to_i420(rgb)
    assert i420.shape == want.shape and i420.dtype == np.uint8
    assert np.abs(i420.astype(np.int16) - want).max() <= 1


@pytest.mark.unit
def test_torch_cpu_converts_frames_to_i420_as_opencv_does() -> None:
    rgb, i420 = torch_engine(device="cpu"), torch_engine(device="cpu", pixels="i420")
    for size in (256, 512):
        batch = frames([rgb.prepare(portrait(size))], 3)
        assert i420.prepare(portrait(size)) == batch[0].slot
        assert_i420_of(i420.run(batch).frames, rgb.run(batch).frames)


@pytest.mark.unit
def test_an_i420_kernel_that_fails_to_build_gives_way_to_torch_ops(
        caplog: pytest.LogCaptureFixture) -> None:
    """Triton builds its launcher with the host's C compiler at first use; where that
    fails, frames still come out in I420, and the log says why once (on the GPU where
    there is one)."""
    import torch

    from inference.runtimes.device_pixels import DeviceI420

    def kernel_without_a_compiler(frames: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable")

    convert = DeviceI420(on_gpu=True, kernel=kernel_without_a_compiler)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rgb = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8, device=device)
    for _ in range(2):
        out = convert(rgb)
        assert out.device == rgb.device
        assert_i420_of(out.cpu().numpy(), rgb.cpu().numpy())
    assert convert.kernel is None
    assert caplog.text.count("the I420 kernel failed") == 1


@pytest.mark.unit
def test_torch_cpu_motion_alone_matches_the_onnx_motion_graph() -> None:
    onnx = OnnxRuntimeEngine(manifest())
    engine = torch_engine(device="cpu")
    slots = [engine.prepare(portrait(256)), engine.prepare(portrait(512))]
    batch = frames(slots, 12)
    np.testing.assert_allclose(engine.run_motion(batch), onnx.run_motion(
        frames([onnx.prepare(portrait(256))], 12)), atol=5e-4)


@pytest.mark.unit
def test_ungrouped_convolutions_keep_the_audio_heads_coefficients() -> None:
    import torch

    from inference.model.export import build_model
    from inference.runtimes.torch_cuda import ungroup_convolutions

    model = build_model()
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv1d)]
    assert any(c.groups > 1 for c in convs), "the shipped head has members"
    mel = torch.from_numpy(windows()[:24])
    with torch.no_grad():
        grouped = model.head(mel)
        ungroup_convolutions(model)
        dense = model.head(mel)
    assert all(c.groups == 1 for c in convs)
    assert float(grouped.max()) > 0.3, "the speech opens the mouth"
    torch.testing.assert_close(dense, grouped, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------- CUDA path
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("size", [256, 512])
@pytest.mark.parametrize("opts", [{"precision": "fp16", "compile": False},
                                  {"precision": "amp", "compile": False},
                                  {"precision": "fp16", "compile": True}])
def test_torch_cuda_fp16_matches_onnxruntime(size: int, opts: dict[str, object]) -> None:
    count = len(windows())
    ref = reference(size, count)
    engine = torch_engine(device="cuda", batch_sizes=(1, 4, 16), **opts)
    slot = engine.prepare(portrait(size))
    out = engine.run(frames([slot], count))
    d = np.abs(out.frames.astype(np.int16) - ref.frames.astype(np.int16))
    print(f"{opts} {size}: max {d.max()} mean {d.mean():.4f} coef "
          f"{np.abs(out.coefficients - ref.coefficients).max():.2e}")
    assert_close(out.frames, ref.frames, 32, 1.0, outlier_grey=8)
    np.testing.assert_allclose(out.coefficients, ref.coefficients, atol=1e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("opts", [{"precision": "fp16", "compile": False},
                                  {"precision": "amp", "compile": False},
                                  {"precision": "fp16", "compile": True},
                                  {"precision": "fp16", "cuda_graphs": False,
                                   "compile": False}])
def test_torch_cuda_motion_alone_matches_the_onnx_motion_graph(opts: dict[str, object]) -> None:
    onnx = OnnxRuntimeEngine(manifest())
    engine = torch_engine(device="cuda", batch_sizes=(1, 4, 16), **opts)
    slots = [engine.prepare(portrait(256)), engine.prepare(portrait(512))]
    count = len(windows())  # more than the largest graph: chunks, the last one padded
    out = engine.run_motion(frames(slots, count))
    again = engine.run_motion(frames(slots, 3))  # graphs replayed with fewer rows
    np.testing.assert_allclose(again, out[:3], atol=1e-5)
    assert np.isfinite(out).all()  # FP32 even under amp: silence gives no NaN
    np.testing.assert_allclose(out, onnx.run_motion(
        frames([onnx.prepare(portrait(256))], count)),
        atol=1e-2 if opts["precision"] == "amp" else 2e-3)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("opts", [{"precision": "fp32", "compile": False},
                                  {"precision": "fp32", "cuda_graphs": False,
                                   "compile": False}])
def test_torch_cuda_fp32_matches_onnxruntime(opts: dict[str, object]) -> None:
    ref = reference(256, 12)
    engine = torch_engine(device="cuda", batch_sizes=(1, 4, 16), **opts)
    slot = engine.prepare(portrait(256))
    out = engine.run(frames([slot], 12))
    assert_close(out.frames, ref.frames, 16, 0.05, outlier_grey=2)
    np.testing.assert_allclose(out.coefficients, ref.coefficients, atol=5e-4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("compile", [False, True])
def test_torch_cuda_converts_frames_to_i420_on_the_device(compile: bool) -> None:
    rgb = torch_engine(device="cuda", batch_sizes=(1, 4), compile=compile)
    i420 = torch_engine(device="cuda", batch_sizes=(1, 4), compile=compile, pixels="i420")
    for size in (256, 512):
        batch = frames([rgb.prepare(portrait(size))], 6)  # a chunk of 4, then 2 padded
        assert i420.prepare(portrait(size)) == batch[0].slot
        assert_i420_of(i420.run(batch).frames, rgb.run(batch).frames)


@pytest.mark.gpu
@needs_cuda
def test_the_device_i420_kernel_converts_strided_and_packed_frames_as_opencv_does() -> None:
    """The renderer's frames are an NHWC view of NCHW planes; a packed batch must come
    out the same (an odd-sized batch of odd content: noise, black, white)."""
    import torch

    pytest.importorskip("triton", reason="Triton, which PyTorch's CUDA builds bring, is absent")
    from inference.runtimes.device_pixels import i420_triton

    planar = torch.randint(0, 256, (5, 3, 512, 512), dtype=torch.uint8, device="cuda")
    planar[3], planar[4] = 0, 255
    for rgb in (planar.permute(0, 2, 3, 1), planar.permute(0, 2, 3, 1).contiguous()):
        assert_i420_of(i420_triton(rgb).cpu().numpy(), rgb.cpu().numpy())
    assert i420_triton(planar[:0].permute(0, 2, 3, 1)).shape == (0, 768, 512)


@pytest.mark.gpu
@needs_cuda
def test_torch_cuda_padding_and_chunks() -> None:
    engine = torch_engine(device="cuda", batch_sizes=(1, 2, 4, 8), max_chunk=4)
    slots = [engine.prepare(portrait(256)) for _ in range(3)]
    batch = frames(slots, 11)  # chunks 4 + 4 + 3 (padded to 4)
    alone = [engine.run([item]) for item in batch]
    out = engine.run(batch)
    odd = engine.run(batch[:3])  # 3 padded to 4
    for i in range(11):
        assert_close(out.frames[i], alone[i].frames[0], 1, 0.01)
        np.testing.assert_allclose(out.coefficients[i], alone[i].coefficients[0], atol=1e-5)
    for i in range(3):
        assert_close(odd.frames[i], alone[i].frames[0], 1, 0.01)


@pytest.mark.gpu
@needs_cuda
def test_torch_cuda_slots_isolated_and_bank_growth() -> None:
    engine = torch_engine(device="cuda", batch_sizes=(1, 2, 4), initial_slots=2)
    _check_isolation(engine)
    a = engine.prepare(portrait(256))
    before = engine.run(frames([a], 4))
    grown = [engine.prepare(portrait(256, mirrored=True)) for _ in range(5)]  # recapture
    after = engine.run(frames([a], 4))
    np.testing.assert_array_equal(before.frames, after.frames)
    assert engine._banks[256].capacity >= 6 and grown


@pytest.mark.gpu
@needs_cuda
def test_torch_cuda_amp_never_returns_non_finite() -> None:
    engine = torch_engine(device="cuda", precision="amp", batch_sizes=(1, 2))
    slot = engine.prepare(portrait(256))
    shape = (manifest().window_frames, manifest().features.n_mels)
    for level in (-10.0, 6.0):  # digital silence (FP16 underflow) and the clamp's top
        mel = np.full(shape, level, np.float32)
        out = engine.run([FrameInput(slot, mel, np.ones(2, np.float32), np.zeros(2, np.float32))])
        assert np.isfinite(out.coefficients).all()


# ---------------------------------------------------------------------- TensorRT
@pytest.mark.unit
def test_tensorrt_module_imports_without_tensorrt() -> None:
    from inference.runtimes import tensorrt as trt_runtime

    assert hasattr(trt_runtime, "TensorRtEngine")
    if importlib.util.find_spec("tensorrt") is None:
        with pytest.raises(RuntimeError, match="TensorRT"):
            trt_runtime.TensorRtEngine(manifest())


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None or not _cuda(),
                    reason="TensorRT is not installed here (the builder is not installable)")
def test_tensorrt_fp16_matches_onnxruntime(tmp_path: Path) -> None:
    from inference.runtimes.tensorrt import TensorRtEngine
    from inference.runtimes.tensorrt_build import build_engines

    build_engines(MANIFEST_PATH, precision="fp16", sizes=[256], batch_sizes=(1, 4, 16),
                  cache_dir=tmp_path)
    engine = TensorRtEngine(manifest(), precision="fp16", cache_dir=tmp_path,
                            batch_sizes=(1, 4, 16))
    slot = engine.prepare(portrait(256))
    out = engine.run(frames([slot], 12))
    assert_close(out.frames, reference(256, 12).frames, 32, 1.0, outlier_grey=8)


@pytest.mark.unit
def test_tensorrt_slot_gather_graph_matches_the_shipped_onnx() -> None:
    """The graph TensorRT builds from (portraits gathered from a bank by slot), run on
    onnxruntime here: the same frames as the shipped graph fed each portrait directly."""
    import onnxruntime as ort

    from inference.runtimes.tensorrt_build import slot_gather_onnx

    m = manifest()
    wrapped = ort.InferenceSession(slot_gather_onnx(Path(m.onnx).read_bytes()),
                                   providers=["CPUExecutionProvider"])
    people = [portrait(256), portrait(256, mirrored=True)]
    bank = np.stack([p.image.transpose(2, 0, 1).astype(np.float32) / 255 for p in people])
    batch = frames([0, 1], 4)
    got = wrapped.run(None, {
        "mel": np.stack([f.mel for f in batch]), "knobs": np.stack([f.knobs for f in batch]),
        "clock": np.stack([f.clock for f in batch]), "slot": np.array([0, 1, 0, 1], np.int32),
        "portrait_bank": bank, "geometry_bank": np.stack([p.geometry for p in people])})
    engine = OnnxRuntimeEngine(m)
    slots = [engine.prepare(p) for p in people]
    want = engine.run(frames(slots, 4))
    assert_close(got[0], want.frames, 1, 0.001)  # rounding of a differently fused graph
    np.testing.assert_allclose(got[1], want.coefficients, atol=1e-6)


@pytest.mark.gpu
@needs_cuda
def test_torch_cuda_captures_with_the_collector_held_off() -> None:
    """An engine is freed by Python's cyclic collector, whenever that runs; a collection on
    the capturing thread mid-capture invalidates the capture (cudaErrorStreamCapture-
    Invalidated: seen with amp at 512 on an H200, and reproduced there by collecting an
    old engine from inside the captured forward). So capture runs with the collector off,
    and garbage made meanwhile waits for the collector's next run."""
    old = torch_engine(device="cuda", batch_sizes=(1, 4), compile=False)
    old.run(frames([old.prepare(portrait(256))], 4))
    holder = [weakref.ref(old)]
    engine = torch_engine(device="cuda", precision="amp", batch_sizes=(1, 4, 16),
                          compile=False)
    slot = engine.prepare(portrait(512))
    forward = engine.model.forward
    collector_on: list[bool] = []

    def forward_while_capturing(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal old
        if torch.cuda.is_current_stream_capturing():
            collector_on.append(gc.isenabled())
            old = None  # garbage now: only the collector can free it
        return forward(*args, **kwargs)

    engine.model.forward = forward_while_capturing  # type: ignore[method-assign]
    thresholds = gc.get_threshold()
    gc.set_threshold(1)  # would collect at almost every allocation
    try:
        out = engine.run(frames([slot], 16))
    finally:
        gc.set_threshold(*thresholds)
    assert collector_on and not any(collector_on)  # every capture ran with it off
    assert gc.isenabled() and np.isfinite(out.coefficients).all()
    gc.collect()
    assert holder[0]() is None  # and the old engine went at the next collection
