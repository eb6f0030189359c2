"""The load generator (``benchmarks.sessions``) reports the steady state of every session."""

from __future__ import annotations

import os

import pytest


@pytest.mark.e2e
def test_the_load_generator_measures_all_sessions_once_every_offer_is_answered(speech_wav):
    """Peers in other processes start together with the local one (client processes take
    seconds to start), the window opens only once every session is live on the server, and
    fps and the server's counters are taken over that window. Points run one after another
    on one server (a GPU runtime's start-up takes minutes)."""
    from benchmarks.sessions import run_points
    from server.config import SessionSettings

    row, motion = run_points([(256, 3, False), (256, 2, True)], 12.0, speech_wav, [],
                             client_processes=2, decoded=1)
    assert motion["point"] == "motionx2" and motion["sessions_measured"] == 2
    assert motion["fps_min"] >= 20.0 and motion["restarts"] == {}
    assert row["served"] == 3 and row["refused"] == 0
    assert row["sessions_measured"] == 3
    sessions = row["per_session"]
    assert len(sessions) == 3 and all(s["fps"] >= 20.0 for s in sessions)
    # The server's own figures for each session: its audio held for the configured delay.
    configured = SessionSettings().pipeline_delay_ms
    assert all(s["pipeline_delay_ms"]["p50"] >= configured - 20 for s in sessions), sessions
    assert 4.0 <= row["window_s"] <= 12.0
    # A 12 s run: each session's latest 500 frames began before the window did.
    assert row["pipeline_delay_steady"] is False
    assert row["fps_min"] >= 20.0 and row["fps_median"] <= 26.0
    assert row["repeated_%"] is not None and row["server_cpu_cores"] > 0
    # The machine's cores, every tick of the window accounted for.
    assert sum(row["host_cores"].values()) == pytest.approx(os.cpu_count(), abs=0.3)
    assert row["cpu_unmeasured"] == [] and row["restarts"] == {}
    # The two counting peers reported how late they sent their speech.
    assert None not in (row["peer_late_ms_p95_median"], row["peer_late_ms_p99_worst"]), row


@pytest.mark.unit
def test_a_peer_late_by_a_burst_shows_in_its_quantiles_only_inside_the_window():
    """Packets over the lateness floor are listed with their times; the rest of the window's
    20 ms packets count as on time, and packets outside the window do not count."""
    from benchmarks.sessions import _late_ms

    # A 10 s window (500 packets), one stall: 30 packets 80 down to 22 ms late, and one
    # 300 ms late before the window opened.
    late = [(5.0, 300.0)] + [(20.0 + 0.001 * i, 80.0 - 2.0 * i) for i in range(30)]
    assert _late_ms(late, 10.0, 30.0, 0.02, 0.99, 0.95) == [
        60.0,  # of 1,000 packets: the 11th latest
        0.0]  # 30 late packets are 3% of them
    assert _late_ms(late, 15.0, 25.0, 0.02, 0.95) == [30.0]  # of 500: the 26th latest
    assert _late_ms(late, 15.0, 25.0, 0.04, 0.95) == [56.0]  # of 250 40 ms packets: 13th
    assert _late_ms([], 10.0, 30.0, 0.02, 0.99) == [0.0]


@pytest.mark.unit
async def test_the_answer_asks_for_a_packet_length_and_peers_read_it_back():
    """``a=ptime`` goes into the audio section only, and a load generator's peer reads it
    back as a browser does (``asked_ptime``)."""
    from aiortc import RTCConfiguration, RTCPeerConnection

    from server.client.peer import asked_ptime
    from server.media.peer import with_ptime

    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    try:
        pc.addTransceiver("audio", direction="sendrecv")
        pc.addTransceiver("video", direction="recvonly")
        await pc.setLocalDescription(await pc.createOffer())
        sdp = pc.localDescription.sdp
    finally:
        await pc.close()
    assert asked_ptime(sdp) is None
    asked = with_ptime(sdp, 40)
    assert asked_ptime(asked) == 40 and asked.count("a=ptime:") == 1
    audio, video = asked.split("m=video")
    assert "a=ptime:40\r\n" in audio and "ptime" not in video.replace("minptime", "")
    assert asked_ptime(with_ptime(sdp.split("m=video")[0].rstrip() + "\r\n", 60)) == 60


@pytest.mark.unit
def test_a_late_sender_report_does_not_shift_the_times_a_stream_was_sent():
    from server.client.peer import Stream

    stream = Stream("video", pts=[0, 3600, 7200], rtp_origin=(1 << 32) - 3600)
    # Two reports of one clock, the second noted 25 ms after its packet's time (a busy
    # sender), and both across the RTP timestamp's wrap.
    stream.reports = [(1000.0, (1 << 32) - 3600), (1001.025, 86400)]
    assert stream.sender_times().tolist() == pytest.approx([1000.0, 1000.04, 1000.08])
    stream.reports.reverse()  # whichever came last
    assert stream.sender_times().tolist() == pytest.approx([1000.0, 1000.04, 1000.08])
