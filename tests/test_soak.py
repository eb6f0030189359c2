"""A short soak in CI (``benchmarks/soak.py`` runs it for 30 minutes): sessions joining
and leaving over lossy, delayed networks with stalled and skewed senders, offers that
never connect and hostile requests, around one long session that must not notice."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import ServerProcess

from benchmarks.soak import soak
from inference.tts import SpeechUnavailable, conversation

pytestmark = pytest.mark.soak


def test_churn_bad_networks_and_hostile_requests_leave_the_server_as_it_was():
    try:
        pcm = conversation(48000).astype(np.int16)
    except SpeechUnavailable as exc:
        pytest.skip(str(exc))
    # The peers share the two cores with the server here, and the CPU engine renders a
    # frame in 5-10 ms: bursts of their work (handshakes, decoding over the bad networks)
    # made some frames miss the default 130 ms delay's 28 ms of slack. 20 ms more keeps
    # what this test is about, the long session not noticing the churn, apart from that.
    # Once the server has measured a session here (about 0.25 cores with the CPU engine),
    # the long one, two transients and an offer that never connects come near the default
    # 0.8 of the two cores, and admission refused most transients. Churn at the limit is
    # what this test is about, so the server may fill 0.95 of its cores; the long session
    # must still not notice.
    with ServerProcess("--set", "session.peer_timeout_s=3",
                       "--set", "session.pipeline_delay_ms=150",
                       "--set", "session.max_host_load=0.95") as server:
        report = asyncio.run(soak(server.url, server.proc.pid, pcm, seconds=40.0))
    summary = report.summary()
    assert report.cycles >= 8, summary
    assert report.transient_failures == [] and report.bad_answers == [], summary
    assert report.hostile_answers >= 8 * 9
    # A busy 2-core machine may refuse some offers at admission (503 before the offer is
    # read): designed, but not most of the time.
    assert report.refused <= report.hostile_answers // 4, summary
    # The long session kept its frame rate, its delay and lips with sound.
    assert min(report.steady_fps) >= 24.0, summary
    # Its delay stays near the 130 ms pipeline delay plus the jitter buffer. On this shared
    # 2-core machine one hiccup of the peers' own load can lift the p95 of the server's
    # 20 s window for the rest of a 40 s run (271 ms seen once), not its median.
    assert max(report.steady_delay_p50_ms) <= 200, summary
    assert max(report.steady_delay_p95_ms) <= 400, summary
    # Lips with sound: the typical frame leaves with its audio. Frames repeated while the
    # engine was late count as far off as their picture is old; with a CI machine's cores
    # contended that lifted the p95 of the 20 s window to 177 ms while the session still
    # had its 25 fps and delay; repeated freezes of 10 frames and more would not pass.
    assert max(report.steady_av_p50_ms) <= 20, summary
    assert max(report.steady_av_p95_ms) <= 400, summary
    fps = summary["transient_fps_median"]
    assert all(fps[kind] >= 24.0 for kind in ("clean", "stalled", "fast clock",
                                              "slow clock")), fps
    assert all(fps[kind] >= 20.0 for kind in ("lossy", "bad network")), fps
    # Nothing held: every process has the descriptors it had after the first round (the
    # front door's HTTP connections to the workers, which it reads each second, come and
    # go at both ends: one a worker) and no thread per session: before the fix each of the
    # 16 or more sessions left two behind. An executor may still grow to its bound, a
    # thread at a time.
    slack = {"front_door": 2, "workers": 1}
    for kind, start in report.start.items():
        end = report.end[kind]
        assert end.threads <= start.threads + 2, (kind, start, end)
        assert abs(end.fds - start.fds) <= slack.get(kind, 0), (kind, start, end)
