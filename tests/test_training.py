"""The audio head's training pieces and the shipped head's behaviour (fast)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from inference.engine import FeatureSpec
from inference.features import log_mel
from inference.model.timing import TIMING
from inference.tts import (
    SAMPLE_RATE,
    Espeak,
    SpeechFailed,
    SpeechUnavailable,
    Utterance,
    festival_batch,
    flite,
    run_tool,
)

torch = pytest.importorskip("torch", reason="the model is defined in PyTorch (the dev extra)")

from inference.model.audio_head import HEAD_WEIGHTS, AudioHead
from inference.model.blendshapes import SPEECH
from inference.training import augment
from inference.training.corpus import alignment_check
from inference.training.visemes import (
    _TABLE,
    _TRANSPARENT,
    LEADS,
    JawTarget,
    Leads,
    Segment,
    V,
    frame_targets,
    segments_from_phonemes,
)
from inference.training.windows import Windows, make_windows

pytestmark = pytest.mark.unit

WINDOW = TIMING.window_frames  # mel frames per window, as the engine takes them

JAW = SPEECH.index("jawOpen")
SR = SAMPLE_RATE
TEXT = "Hello there, my lips follow your voice."


@pytest.fixture(scope="module")
def sentence() -> Utterance:
    try:
        return Espeak.get().synth(f"{TEXT} Stop.", "en-us")
    except SpeechUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def head() -> AudioHead:
    return AudioHead.from_weights(HEAD_WEIGHTS)  # missing weights fail, they do not skip


def _run(head: AudioHead, audio: np.ndarray) -> np.ndarray:
    windows = make_windows([(audio.astype(np.float32), None)])
    with torch.no_grad():
        return head(windows.batch(np.arange(windows.starts.size))).numpy()


def _assert_aligned(utt: Utterance) -> None:
    """Phonemes in order, covering the clip, silence phonemes on its quiet parts."""
    starts = [s for s, _, _ in utt.phones]
    assert starts == sorted(starts) and starts[0] < 0.1
    assert all(e >= s for s, e, _ in utt.phones)
    assert utt.phones[-1][1] == pytest.approx(utt.seconds)
    silent_db, speech_db = alignment_check(utt)
    assert silent_db < speech_db - 15


def test_phoneme_events_monotonic_and_aligned(sentence: Utterance) -> None:
    _assert_aligned(sentence)


def test_festival_segments_monotonic_and_aligned() -> None:
    try:
        slow, fast = festival_batch([(TEXT, 1.4, 160.0, 20.0), (TEXT, 0.8, 90.0, 10.0)])
    except SpeechUnavailable as exc:  # festival, or its kal_diphone voice, is not installed
        pytest.skip(str(exc))
    for utt in (slow, fast):
        _assert_aligned(utt)
        assert utt.phones[0][0] == 0.0
        assert all(p in _TABLE or p in _TRANSPARENT for _, _, p in utt.phones)  # CMU set
    assert slow.seconds > 1.3 * fast.seconds  # Duration_Stretch took effect


@pytest.mark.parametrize("voice", ["slt", "awb", "rms", "kal16"])
def test_flite_phones_monotonic_and_aligned(voice: str) -> None:
    try:
        utt = flite(TEXT, voice)
    except SpeechUnavailable as exc:
        pytest.skip(str(exc))
    _assert_aligned(utt)
    assert all(p in _TABLE or p in _TRANSPARENT for _, _, p in utt.phones)


def test_synthesizer_failure_carries_the_tools_own_message(tmp_path: Path) -> None:
    if shutil.which("festival") is None:
        pytest.skip("festival is not installed")
    script = tmp_path / "broken.scm"
    script.write_text("(no_such_function)\n")
    with pytest.raises(SpeechFailed, match="unbound variable : no_such_function"):
        run_tool(["festival", "-b", str(script)])


def test_audio_head_removes_spectral_tilt() -> None:
    model = AudioHead()
    model.tilt_norm = True  # an option (off in the shipped head)
    frame = torch.randn(80) * 0.3 - 4.0
    mel = frame.expand(1, WINDOW, 80).clone()
    tilt = torch.linspace(-0.5, 0.5, 80)  # +-5 dB across the band
    a, b = model.features(mel)[0][0, :80], model.features(mel + tilt)[0][0, :80]
    diff = a - b  # only a level offset is left: the tilt itself is gone
    assert float((diff - diff.mean()).abs().max()) < 1e-4


def test_viseme_targets_closed_in_silence_open_on_vowels() -> None:
    phones = [(0.0, 0.5, "_"), (0.5, 0.8, "A:"), (0.8, 0.9, "p"), (0.9, 1.2, "aa"),
              (1.2, 2.0, "pau")]
    targets, labels = frame_targets(segments_from_phonemes(phones), 50)
    assert np.abs(targets[:8]).max() < 1e-3 and np.abs(targets[-10:]).max() < 1e-3
    assert targets[15, JAW] > 0.6 and labels[15] == V["AA"]
    closure = targets[19:22, SPEECH.index("mouthClose")].max()  # p at 0.8-0.9 s, led 40 ms
    assert closure > 0.4
    assert frame_targets([Segment(0, 1, V["sil"])], 25)[0].max() == 0.0


def test_the_jaw_and_the_lips_each_lead_the_sound_by_their_own_lead() -> None:
    """With the jaw led 0 ms and the lips 80 ms, an open vowel after silence opens the
    jaw two frames later than the lips leave rest; the lips' own shapes are those of
    one lead for both."""
    phones = [(0.0, 0.6, "pau"), (0.6, 1.2, "ae"), (1.2, 2.0, "pau")]
    segs = segments_from_phonemes(phones)
    same, _ = frame_targets(segs, 50, leads=Leads(0.08, 0.08))
    split, labels = frame_targets(segs, 50, leads=Leads(jaw=0.0, lips=0.08))
    lips = [k for k in range(len(SPEECH)) if k != JAW]
    assert np.array_equal(split[:, lips], same[:, lips])
    stretch = split[:, SPEECH.index("mouthStretchLeft")]
    jaw_opens, lips_spread = (int(np.argmax(x > 0.5 * x.max())) for x in (split[:, JAW],
                                                                          stretch))
    assert jaw_opens - lips_spread == 2  # 80 ms at 25 fps
    assert labels[lips_spread + 1] == V["AE"]
    with pytest.raises(ValueError, match="jaw lead"):
        Leads(jaw=-0.01)


def test_a_vowels_jaw_target_can_follow_its_height_rather_than_its_viseme() -> None:
    """/iy/ and /ih/ share the viseme IH; by vowel, /ih/ opens the jaw more than /iy/
    (CMU phones and espeak's mnemonics alike), a held vowel reaches its own height, and
    every lip shape stays as the visemes make it."""
    phones = [(0.0, 0.4, "pau"), (0.4, 1.0, "iy"), (1.0, 1.4, "pau"), (1.4, 2.0, "ih"),
              (2.0, 2.4, "pau"), (2.4, 3.0, "i:"), (3.0, 3.4, "_"), (3.4, 4.0, "I"),
              (4.0, 4.4, "_")]
    by_viseme, labels = frame_targets(segments_from_phonemes(phones), 110)
    by_vowel, same_labels = frame_targets(segments_from_phonemes(phones, jaw_by_vowel=True),
                                          110)
    lips = [k for k in range(len(SPEECH)) if k != JAW]
    assert np.array_equal(by_vowel[:, lips], by_viseme[:, lips])
    assert np.array_equal(labels, same_labels)
    held = {name: by_vowel[int(25 * (start + end) / 2) - 1, JAW]
            for start, end, name in phones if name not in ("pau", "_")}
    assert held["iy"] == pytest.approx(0.25, abs=0.01)
    assert held["ih"] == pytest.approx(0.35, abs=0.01)
    assert held["i:"] == pytest.approx(held["iy"], abs=0.01)
    assert held["I"] == pytest.approx(held["ih"], abs=0.01)
    assert by_viseme[int(25 * 0.7) - 1, JAW] == pytest.approx(by_viseme[int(25 * 1.7) - 1, JAW])
    assert np.abs(by_vowel[:6, JAW]).max() < 1e-3  # silence stays closed


def test_a_short_vowel_between_bilabials_opens_the_jaw_further_without_dominance() -> None:
    """The lips' dominance lets /p/ and /m/ pull a short /aa/'s jaw far down; blended
    alike, the jaw goes nearer the vowel's height, while the lips and labels stay as the
    visemes make them and silence stays closed."""
    phones = [(0.0, 0.4, "pau"), (0.4, 0.5, "p"), (0.5, 0.6, "aa"), (0.6, 0.7, "m"),
              (0.7, 1.2, "pau")]
    segs = segments_from_phonemes(phones, jaw_by_vowel=True)
    weighted, labels = frame_targets(segs, 30)
    alike, same_labels = frame_targets(segs, 30, jaw_dominance=False)
    lips = [k for k in range(len(SPEECH)) if k != JAW]
    assert np.array_equal(alike[:, lips], weighted[:, lips])
    assert np.array_equal(labels, same_labels)
    vowel = int(25 * 0.55) - 1  # the frame showing /aa/ at the 40 ms lead
    assert alike[vowel, JAW] > weighted[vowel, JAW] + 0.1
    assert alike[vowel, JAW] < 0.9
    assert np.abs(alike[:5, JAW]).max() < 1e-3 and np.abs(alike[-5:, JAW]).max() < 1e-3
    assert JawTarget(by_vowel=True, dominance=False).describe() == \
        "each vowel's height, blended without dominance"


def test_saved_windows_train_elsewhere_as_built_within_a_quantisation_step(
        tmp_path: Path, sentence: Utterance) -> None:
    """Windows saved on the machine with the synthesizers load (on a GPU host) with the
    same targets and a mel within half an 8-bit step of what the head would read."""
    from inference.training.train import main

    built = make_windows([(sentence.audio, sentence.phones), (np.zeros(SR, np.float32), None)])
    path = tmp_path / "w.npz"
    leads = {"jaw": LEADS.jaw, "lips": LEADS.lips}
    built.save(path, {"command": "python -m inference.training.train",
                      "description": {"targets": {"leads_s": leads}}})
    loaded, meta = Windows.load(path)
    low, high = AudioHead.mel_range
    step = (high - low) / 255
    want = np.clip(built.mel.astype(np.float32), low, high)
    assert np.abs(loaded.mel.astype(np.float32) - want).max() <= step / 2 + 0.01
    assert np.array_equal(loaded.targets, built.targets)
    assert np.array_equal(loaded.labels, built.labels)
    assert meta["command"] == "python -m inference.training.train"
    idx = np.array([0, 7, loaded.starts.size - 1])
    assert torch.equal(loaded.batcher(torch.device("cpu"))(idx), loaded.batch(idx))
    main(["--windows", str(path), "--no-eval", "--epochs", "1", "--batch", "32",
          "--members", "2", "--out", str(tmp_path / "head.pt")])
    with pytest.raises(SystemExit):  # its targets were led otherwise: not trained on
        main(["--windows", str(path), "--no-eval", "--jaw-lead-ms", "10",
              "--out", str(tmp_path / "other.pt")])
    head = AudioHead.from_weights(tmp_path / "head.pt")
    assert head.members == 2
    assert "--members 2" in json.loads((tmp_path / "head.json").read_text())["command"]
    with torch.no_grad():
        assert torch.isfinite(head(loaded.batch(idx))).all()


def test_an_ensemble_head_gives_its_members_mean_and_loads_back_from_its_weights(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    a, b = AudioHead().eval(), AudioHead().eval()
    joined = AudioHead.ensemble([a, b])
    torch.save(joined.state_dict(), tmp_path / "joined.pt")
    loaded = AudioHead.from_weights(tmp_path / "joined.pt")
    mel = torch.randn(4, WINDOW, 80) - 4.0
    with torch.no_grad():
        want = (a(mel) + b(mel)) / 2
        assert not torch.allclose(a(mel), b(mel), atol=1e-3)  # two members, not one twice
        torch.testing.assert_close(joined(mel), want, atol=1e-6, rtol=0)
        torch.testing.assert_close(loaded(mel), want, atol=1e-6, rtol=0)
    assert loaded.members == 2 and loaded.inp.out_channels == 2 * 96


def test_a_student_trained_with_a_teacher_learns_the_teachers_answers(
        sentence: Utterance) -> None:
    """``--teacher`` with ``--distill 1``: the targets are the teacher's answers (here an
    untrained head's, far from the labels), and the student learns those."""
    from inference.training.train import train_head

    windows = make_windows([(sentence.audio, sentence.phones)])
    torch.manual_seed(1)
    teacher = AudioHead(hidden=16).eval()
    common = {"epochs": 40, "batch": 32, "lr": 4e-3, "seed": 0, "hidden": 16}
    plain = train_head(windows, **common)
    taught = train_head(windows, teacher=teacher, distill=1.0, **common)
    mel = windows.batch(np.arange(windows.starts.size))
    with torch.no_grad():
        answers = teacher(mel)
        from_labels = float((plain(mel) - answers).abs().mean())
        from_teacher = float((taught(mel) - answers).abs().mean())
    assert from_teacher < 0.5 * from_labels, (from_teacher, from_labels)


def test_the_head_computes_only_the_frames_its_pooling_reads_and_agrees_with_the_whole_window(
        ) -> None:
    torch.manual_seed(0)
    head = AudioHead.ensemble([AudioHead().eval(), AudioHead().eval()])
    mel = torch.randn(8, WINDOW, 80) * 2.0 - 4.0
    with torch.no_grad():
        whole, gate = head.per_frame(mel)
        tail, _ = head.per_frame(mel, head.pool_from)
        pooled = (whole * head.kernel[None, :, None]).sum(dim=1) * gate[:, None]
        torch.testing.assert_close(tail, whole[:, head.pool_from:], atol=2e-6, rtol=0)
        torch.testing.assert_close(head(mel), pooled, atol=1e-5, rtol=0)
    assert head.pool_from > WINDOW // 2  # most of the window is left out
    assert float(head.kernel[:head.pool_from].sum()) < 1e-5


def test_augmentations_keep_length_and_finite() -> None:
    rng = np.random.default_rng(0)
    t = np.arange(SR) / SR
    x = (0.3 * np.sin(2 * np.pi * 300 * t) * (t > 0.5)).astype(np.float32)
    for y in (augment.add_noise(x, 10, rng, "pink"), augment.reverb(x, 0.4, rng),
              augment.band_limit(x, 300, 3400), augment.clip(x, 12), augment.set_peak(x, -30),
              augment.random_chain(x, rng, [x])[0]):
        assert y.shape == x.shape and y.dtype == np.float32 and np.isfinite(y).all()
    y = augment.opus_round_trip(x, 24000)
    assert y.shape == x.shape
    onset = int(np.argmax(np.abs(y) > 0.05))
    assert abs(onset - int(np.argmax(np.abs(x) > 0.05))) < 16  # pre-skip removed: < 1 ms
    assert np.corrcoef(x[SR // 2 + 800 :], y[SR // 2 + 800 :])[0, 1] > 0.9


def test_concordance_costs_a_head_that_hedges_towards_the_middle() -> None:
    """A prediction shrunk halfway to the mean correlates perfectly but is not concordant;
    only the target itself scores 1, a constant 0."""
    from inference.training.train import concordance

    target = torch.rand(512, 3, generator=torch.Generator().manual_seed(0))
    hedged = 0.5 * target + 0.5 * target.mean(0)
    assert torch.allclose(concordance(target, target), torch.ones(3), atol=1e-4)
    assert (concordance(hedged, target) < 0.85).all()
    assert torch.allclose(concordance(torch.full_like(target, 0.5), target), torch.zeros(3))


def test_a_warped_vocal_tract_moves_a_formant_up_or_down_the_mel_bands() -> None:
    """VTLP: a tone's mel peak read through a warp of 1.15 lies above where it was, one
    of 0.85 below, and a warp of 1 leaves the mel as it is."""
    from inference.training.train import warp_bands

    t = np.arange(SR) / SR
    mel = torch.from_numpy(log_mel((0.3 * np.sin(2 * np.pi * 1000 * t)).astype(np.float32),
                                   TIMING.features)[None, 10:42])
    table = torch.from_numpy(augment.vtlp_table(TIMING.features, 0.15, steps=3))
    low, same, high = (warp_bands(mel, table[k][None]) for k in range(3))
    assert torch.allclose(same, mel, atol=1e-5)

    def peak(m: torch.Tensor) -> int:
        return int(m[0].mean(0).argmax())

    assert peak(low) < peak(mel) < peak(high)
    centres = augment.mel_centres_hz(TIMING.features)
    assert centres[peak(high)] / centres[peak(mel)] == pytest.approx(1.15, rel=0.08)


def test_a_band_mask_hides_one_run_of_adjacent_bands_behind_each_frames_mean() -> None:
    """Frequency masking: in every window one run of at most ``max_width`` adjacent bands
    (sometimes none) reads as its frame's mean over the bands; the rest is untouched."""
    from inference.training.train import mask_bands

    torch.manual_seed(0)
    mel = torch.randn(256, 32, 80)
    masked = mask_bands(mel, 12)
    widths = []
    for before, after in zip(mel, masked, strict=True):
        changed = torch.nonzero((after != before).any(dim=0)).flatten()
        if changed.numel():
            assert changed.tolist() == list(range(int(changed[0]), int(changed[-1]) + 1))
            mean = before.mean(dim=1, keepdim=True).expand(-1, changed.numel())
            assert torch.equal(after[:, changed], mean)
        widths.append(changed.numel())
    assert max(widths) <= 12 and min(widths) == 0 and len(set(widths)) > 8


def test_shipped_head_silence_and_bad_inputs(head: AudioHead) -> None:
    rng = np.random.default_rng(1)
    t = np.arange(2 * SR) / SR
    silent = _run(head, np.zeros(2 * SR, np.float32))
    assert np.abs(silent).max() < 0.02
    cases = [np.ones(2 * SR, np.float32) * 0.5, np.sign(np.sin(2 * np.pi * 200 * t)),
             rng.standard_normal(2 * SR) * 1e-3, augment.set_peak(augment.music(t, rng), -3),
             np.full(2 * SR, 1.0, np.float32)]
    for audio in cases:
        out = _run(head, audio)
        assert np.isfinite(out).all() and out.min() >= 0.0 and out.max() <= 1.0
    with torch.no_grad():
        assert torch.isfinite(head(torch.full((2, WINDOW, 80), float("nan")))).all()
        silence = torch.full((1, WINDOW, 80), float(np.log10(FeatureSpec().floor)))
        assert float(head(silence)[0].max()) < 0.02


def test_shipped_head_opens_on_speech(head: AudioHead, sentence: Utterance) -> None:
    out = _run(head, augment.set_peak(sentence.audio, -6))
    assert out[:, JAW].max() > 0.4
    quiet = _run(head, augment.set_peak(sentence.audio, -26))
    assert np.abs(quiet[:, JAW] - out[:, JAW]).mean() < 0.08  # 20 dB quieter: same shapes


@pytest.mark.parametrize("members", [1, 2])
def test_audio_head_onnx_matches_torch(tmp_path: Path, members: int) -> None:
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = AudioHead.ensemble([AudioHead() for _ in range(members)])
    mel = torch.randn(3, WINDOW, 80) - 4.0
    mel[1] = -10.0
    path = tmp_path / "head.onnx"
    torch.onnx.export(model, (mel,), str(path), opset_version=17, dynamo=False,
                      input_names=["mel"], output_names=["coefficients"],
                      dynamic_axes={"mel": {0: "batch"}, "coefficients": {0: "batch"}})
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {"mel": mel.numpy()})[0]
    with torch.no_grad():
        want = model(mel).numpy()
    assert got.shape == (3, len(SPEECH))
    np.testing.assert_allclose(got, want, atol=1e-4)
