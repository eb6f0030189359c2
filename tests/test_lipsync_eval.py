"""The lip-sync evaluation's metrics on data whose answer is known, and one quick run."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from inference.model.blendshapes import SPEECH
from inference.training import lipsync_eval as le
from inference.tts import SAMPLE_RATE

pytestmark = pytest.mark.unit

JAW = SPEECH.index("jawOpen")

#: A made-up utterance: pause, "ba", "tee", "moo", "fa", pause (CMU phones).
PHONES = [(0.0, 0.3, "pau"), (0.3, 0.38, "b"), (0.38, 0.6, "aa"), (0.6, 0.68, "t"),
          (0.68, 0.9, "iy"), (0.9, 0.98, "m"), (0.98, 1.2, "uw"), (1.2, 1.3, "f"),
          (1.3, 1.55, "ae"), (1.55, 2.0, "pau")]
N_FRAMES = 50  # 2 s at 25 fps


def targets_at_frames(phones=PHONES, n=N_FRAMES) -> np.ndarray:
    return le.phone_targets(phones, le.frame_centres(n))


# ---------------------------------------------------------------------------- AUC
def test_auc_known_values() -> None:
    assert le.auc([2.0, 3.0, 4.0], [0.0, 1.0]) == 1.0
    assert le.auc([0.0, 1.0], [2.0, 3.0, 4.0]) == 0.0
    assert le.auc([0.5] * 4, [0.5] * 7) == 0.5
    assert le.auc([1.0, 3.0], [2.0]) == 0.5  # one pair above, one below
    assert le.auc([1.0, 2.0], [2.0]) == 0.25  # a tie counts half
    assert math.isnan(le.auc([], [1.0]))


def test_auc_matches_pair_counting() -> None:
    rng = np.random.default_rng(0)
    pos, neg = rng.normal(1, 1, 40).round(1), rng.normal(0, 1, 30).round(1)
    pairs = (pos[:, None] > neg[None]).mean() + 0.5 * (pos[:, None] == neg[None]).mean()
    assert le.auc(pos, neg) == pytest.approx(pairs)


# ---------------------------------------------------------------------------- r and lags
def test_pearson() -> None:
    x = np.arange(10.0)
    assert le.pearson(x, 2 * x + 1) == pytest.approx(1.0)
    assert le.pearson(x, -x) == pytest.approx(-1.0)
    assert math.isnan(le.pearson(x, np.zeros(10)))


@pytest.mark.parametrize("shift_frames", [3, -1, 0])
def test_shifted_jaw_track_gives_its_lag(shift_frames: int) -> None:
    """A jaw track that is the target delayed by k frames is best at lag k * 40 ms."""
    target = targets_at_frames()[:, 0]
    pred = np.roll(target, shift_frames)  # pred[i] = target[i - k]; the ends are silence
    r = le.lag_scan([pred], [PHONES], 0)
    lag, r_best = le.best_lag(le.LAGS_MS, r)
    assert lag == 40 * shift_frames
    assert r_best == pytest.approx(1.0, abs=1e-3)


def test_lag_scan_pools_clips() -> None:
    t = targets_at_frames()[:, 0]
    r = le.lag_scan([t, t[:30]], [PHONES, PHONES[:8]], 0, np.array([0.0]))
    assert r[0] == pytest.approx(1.0, abs=1e-6)


def test_best_lag_ties_and_nans() -> None:
    lags = np.array([-20.0, -10.0, 0.0, 10.0, 20.0])
    assert le.best_lag(lags, np.array([0.9, 0.5, 0.9, 0.5, 0.9])) == (0.0, 0.9)
    assert le.best_lag(lags, np.array([np.nan, 0.2, np.nan, 0.7, 0.1])) == (10.0, 0.7)
    assert all(math.isnan(v) for v in le.best_lag(lags, np.full(5, np.nan)))


# ---------------------------------------------------------------------------- targets
def test_phone_targets_follow_the_table() -> None:
    times = np.array([0.1, 0.34, 0.5, 0.95, 1.1, 1.8])
    tg = le.phone_targets(PHONES, times, sigma_s=0.0)
    jaw, close, rnd = tg.T
    assert jaw[0] == 0 and close[0] == 0 and rnd[0] == 0  # pause
    assert close[1] == 1 and jaw[1] == 0  # b
    assert jaw[2] == pytest.approx(0.9)  # aa
    assert close[3] == 1  # m
    assert rnd[4] == 1  # uw
    assert jaw[5] == 0


def test_phone_targets_smoothing_diphthongs_and_names() -> None:
    smooth = le.phone_targets(PHONES, np.array([0.3]))  # the pause/b edge
    assert 0.0 < smooth[0, 1] < 1.0
    ow = le.phone_targets([(0.0, 0.4, "ow")], np.array([0.05, 0.35]), sigma_s=0.0)
    assert ow[0, 0] > ow[1, 0] and ow[1, 2] == 1.0  # opens, then closes to rounded
    # hh takes the next phone's shape; stress digits and case are ignored
    hh = le.phone_targets([(0.0, 0.1, "HH"), (0.1, 0.3, "AA1")], np.array([0.05]), sigma_s=0.0)
    assert hh[0, 0] == pytest.approx(0.9)
    # a name outside the CMU table (espeak's) falls back on the viseme prototypes
    assert le.phone_shape("@")[0][0] > 0.2 and le.phone_shape("p")[0][1] == 1.0
    assert le.phone_shape("_:") == ((0.0, 0.0, 0.0),)


# ---------------------------------------------------------------------------- segments
def test_segment_means_use_the_lead() -> None:
    score = np.zeros(N_FRAMES)
    score[7:9] = 1.0  # frames centred at 0.30 and 0.34 s
    score[10] = 0.25  # centred at 0.42 s
    # b is [0.30, 0.38): frames 7 and 8 at lag 0
    assert le.segment_means(score, PHONES, frozenset({"b"}), lead_s=0.0) == [1.0]
    # with a 40 ms lead, frame i stands for the sound at its centre + 40 ms: frames 6, 7
    assert le.segment_means(score, PHONES, frozenset({"b"}), lead_s=0.04) == [0.5]
    # a segment too short for any frame centre takes the frame nearest its middle
    short = [(0.401, 0.419, "p")]
    assert le.segment_means(score, short, frozenset({"p"}), 0.0) == [0.25]


def test_quiet_mask_margins() -> None:
    quiet = le.quiet_mask(N_FRAMES, le.speech_spans(PHONES), lead_s=0.0)
    centres = le.frame_centres(N_FRAMES)
    assert np.array_equal(quiet, (centres < 0.2) | (centres >= 1.65))


def test_score_set_on_a_perfect_predictor() -> None:
    """Coefficients that are the targets: r 1 at lag 0, closure and rounding AUCs 1,
    the pause jaw 0; unused shapes give AUC 0.5."""
    tg = targets_at_frames()
    c = np.zeros((N_FRAMES, len(SPEECH)), np.float32)
    c[:, JAW] = tg[:, 0]
    c[:, SPEECH.index("mouthClose")] = tg[:, 1]
    c[:, SPEECH.index("mouthPucker")] = tg[:, 2]
    s = le.score_set([c], [PHONES], le.NO_LEAD)
    assert s["jaw"]["best_lag_ms"] == 0 and s["jaw"]["r_lag0"] == pytest.approx(1.0)
    assert s["closure"]["best_lag_ms"] == 0
    assert s["auc"]["closure_pbm_vs_tdkgnng"]["auc"] == 1.0
    assert s["auc"]["rounding_rounded_vs_spread"]["auc"] == 1.0
    assert s["auc"]["spreading_spread_vs_rounded"]["auc"] == 0.5
    assert s["pause_jaw"]["pct_of_vowels"] == pytest.approx(0.0, abs=1e-6)


# ---------------------------------------------------------------------------- baseline, data
def test_each_articulator_is_read_at_its_own_lead() -> None:
    """A jaw that shows the sound 20 ms ahead and lips that show it 40 ms ahead score r 1
    at their own designed leads, and the AUCs read the lips at theirs."""
    centres = le.frame_centres(N_FRAMES)
    c = np.zeros((N_FRAMES, len(SPEECH)), np.float32)
    c[:, JAW] = le.phone_targets(PHONES, centres + 0.02)[:, 0]
    lips = le.phone_targets(PHONES, centres + 0.04)
    c[:, SPEECH.index("mouthClose")] = lips[:, 1]
    c[:, SPEECH.index("mouthPucker")] = lips[:, 2]
    s = le.score_set([c], [PHONES], le.Leads(jaw=0.02, lips=0.04))
    assert s["jaw"]["designed_lead_ms"] == 20 and s["closure"]["designed_lead_ms"] == 40
    assert s["jaw"]["r_designed_lead"] == pytest.approx(1.0)
    assert s["closure"]["r_designed_lead"] == pytest.approx(1.0)
    assert s["rounding"]["r_designed_lead"] == pytest.approx(1.0)
    assert s["jaw"]["r_lag0"] < 0.99
    assert s["auc"]["rounding_rounded_vs_spread"]["auc"] == 1.0


def test_a_head_says_its_leads_and_an_older_one_its_single_anticipation() -> None:
    assert le.head_leads({"targets": {"leads_s": {"jaw": 0.02, "lips": 0.04}}}) == \
        le.Leads(0.02, 0.04)
    assert le.head_leads({"targets": {"anticipation_s": 0.04}}) == le.Leads(0.04, 0.04)
    assert le.head_leads(None) == le.LEADS


def test_loudness_baseline() -> None:
    assert not le.loudness_baseline(np.zeros(SAMPLE_RATE, np.float32), 25).any()
    t = np.arange(2 * SAMPLE_RATE) / SAMPLE_RATE
    x = (0.3 * np.sin(2 * np.pi * 200 * t) * ((t > 0.5) & (t < 1.5))).astype(np.float32)
    b = le.loudness_baseline(x, 50)
    centres = le.frame_centres(50)
    assert np.all(b[(centres > 0.6) & (centres < 1.4), JAW] == 1.0)
    assert np.all(b[(centres < 0.4) | (centres > 1.6), JAW] == 0.0)
    assert not np.delete(b, JAW, axis=1).any()


def test_pad_clip_labels_the_silence() -> None:
    audio, phones = le.pad_clip(np.ones(SAMPLE_RATE, np.float32), [(0.0, 1.0, "aa")], 0.5, 0.25)
    assert audio.size == int(1.75 * SAMPLE_RATE)
    assert phones == [(0.0, 0.5, "pau"), (0.5, 1.5, "aa"), (1.5, 1.75, "pau")]


def test_noise_is_set_against_the_speech() -> None:
    rng = np.random.default_rng(1)
    audio, phones = le.pad_clip(
        (0.1 * rng.standard_normal(SAMPLE_RATE)).astype(np.float32), [(0.0, 1.0, "aa")], 1, 1)
    noisy = le.speech_snr_noise(audio, phones, 20.0, np.random.default_rng(2))
    speech = slice(SAMPLE_RATE, 2 * SAMPLE_RATE)
    noise = np.delete(noisy - audio, np.arange(SAMPLE_RATE, 2 * SAMPLE_RATE))
    snr = 10 * np.log10(np.mean(audio[speech] ** 2) / np.mean(noise ** 2))
    assert snr == pytest.approx(20.0, abs=0.5)


# ---------------------------------------------------------------------------- end to end
@pytest.mark.skipif(shutil.which("flite") is None,
                    reason="flite is not installed (apt-get install flite): the stand-in "
                           "speech with phone timings comes from it")
def test_end_to_end_on_two_flite_utterances(tmp_path) -> None:
    out = tmp_path / "eval.json"
    report = le.main(["--n", "2", "--no-bad-inputs", "--out", str(out)])
    data = json.loads(out.read_text())  # strict JSON: NaN written as null
    shipped = le.ModelRunner().leads()
    assert data["meta"]["clips"] == 2
    assert data["meta"]["designed_leads_ms"] == {"jaw": 1000 * shipped.jaw,
                                                 "lips": 1000 * shipped.lips}
    for cond in ("clean", "degraded"):
        model, loud = (report["results"][cond][s] for s in ("model", "loudness"))
        assert 0.3 < model["jaw"]["r_designed_lead"] <= 1.0
        assert 0.3 < loud["jaw"]["r_lag0"] <= 1.0
        assert -200 <= model["jaw"]["best_lag_ms"] <= 200
        assert loud["auc"]["rounding_rounded_vs_spread"]["auc"] == 0.5  # its shapes are 0
    if report["onnx_vs_pt"] is not None:  # the exported engine is the .pt head
        assert report["onnx_vs_pt"]["max_abs_diff_onnx_vs_pt_head"] < 1e-3
    assert "| clean | model |" in data["table"]


@pytest.mark.skipif(shutil.which("flite") is None, reason="flite is not installed")
def test_aligned_labels_land_near_the_synthesizers_own_timings() -> None:
    """pocketsphinx's alignment of flite's text (how the real recordings are labelled)
    finds flite's own phones (names from flite word by word, so a vowel may differ from
    flite's in context), their starts within 20 ms at the median."""
    pytest.importorskip("pocketsphinx", reason="the real-speech extra (the aligner)")
    clips = le.flite_set(2, 0)
    aligned = le.aligned_labels(clips)
    assert len(aligned) == 2
    for own, by_aligner in zip(clips, aligned, strict=True):
        speech = [[(s, p) for s, _, p in c.phones if p != "pau"] for c in (own, by_aligner)]
        assert len(speech[0]) == len(speech[1])
        same = [a == b for (_, a), (_, b) in zip(*speech, strict=True)]
        assert sum(same) >= 0.8 * len(same)
        errors = [abs(a - b) for (a, _), (b, _) in zip(*speech, strict=True)]
        assert np.median(errors) < 0.02
        assert by_aligner.phones[-1][1] == pytest.approx(own.audio.size / SAMPLE_RATE)


@pytest.mark.skipif(shutil.which("flite") is None, reason="flite is not installed")
def test_model_runner_gives_one_row_per_video_frame() -> None:
    from inference.tts import flite

    u = flite("Hello.", "slt")
    c = le.ModelRunner().coefficients(u.audio)
    assert c.shape == (-(-u.audio.size * le.FPS // SAMPLE_RATE), len(SPEECH))
    assert np.isfinite(c).all() and 0.0 <= c.min() and c.max() <= 1.0
    assert le.ModelRunner().coefficients(np.zeros(SAMPLE_RATE, np.float32)).max() < 1e-4


def test_unknown_phones_are_listed() -> None:
    assert le.unknown_phones([le.Clip(np.zeros(1), [(0, 1, "AA1"), (1, 2, "zz")], "a")]) \
        == {"zz": 1}
