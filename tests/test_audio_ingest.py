import os

import av
import numpy as np
import pytest

from server.media.audio_ingest import AudioIngest, Resampler, to_mono_48k
from server.media.clock import MediaClock


def _ingest() -> AudioIngest:
    return AudioIngest(chunk_samples=960, jitter_ms=40, max_buffer_ms=200)


@pytest.mark.unit
def test_buffer_waits_for_a_chunk_plus_the_jitter_target_then_streams_in_order():
    ingest = _ingest()
    for i in range(2):
        ingest.push(np.arange(960 * i, 960 * (i + 1), dtype=np.int16), arrival=1.0 + 0.02 * i)
        chunk, arrival = ingest.read()
        assert arrival is None and not chunk.any()  # still filling to 20 + 40 ms
    ingest.push(np.arange(1920, 2880, dtype=np.int16), arrival=1.04)
    chunk, arrival = ingest.read()
    assert arrival == 1.0 and chunk[0] == 0 and chunk[-1] == 959
    chunk, arrival = ingest.read()
    assert arrival == 1.02 and chunk[0] == 960


@pytest.mark.unit
def test_underrun_gives_silence_and_refills():
    ingest = _ingest()
    ingest.push(np.ones(2880, np.int16), 0.0)
    ingest.read(), ingest.read(), ingest.read()
    chunk, arrival = ingest.read()
    assert arrival is None and not chunk.any()
    assert ingest.stats.underruns == 1


@pytest.mark.unit
def test_overflow_drops_oldest_down_to_target():
    ingest = _ingest()
    for i in range(11):  # 220 ms > 200 ms limit
        ingest.push(np.full(960, i, np.int16), float(i))
    assert ingest.level == 2880  # back to a chunk plus the 40 ms target
    chunk, arrival = ingest.read()
    assert chunk[0] == 8 and arrival == 8.0
    assert ingest.stats.dropped_samples == 11 * 960 - 2880


@pytest.mark.unit
def test_stereo_s16_takes_one_channel_without_gain():
    stereo = np.zeros((1, 1920), np.int16)
    stereo[0, 0::2] = 1000
    stereo[0, 1::2] = 1000
    frame = av.AudioFrame.from_ndarray(stereo, format="s16", layout="stereo")
    frame.sample_rate = 48000
    mono = to_mono_48k(frame, Resampler(48000))
    assert mono.shape == (960,) and (mono == 1000).all()


@pytest.mark.unit
def test_other_rates_are_resampled_to_48k():
    t = np.arange(1600) / 16000
    pcm = (8000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16).reshape(1, -1)
    resampler = Resampler(48000)
    total = 0
    for _ in range(5):
        frame = av.AudioFrame.from_ndarray(pcm, format="s16", layout="mono")
        frame.sample_rate = 16000
        total += to_mono_48k(frame, resampler).size
    assert abs(total - 5 * 4800) <= 64


@pytest.mark.unit
def test_the_resampler_matches_pyav_and_holds_no_threads():
    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    t = np.arange(960 * 10) / 48000
    pcm = (8000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16).reshape(10, 1, 960)

    def frames():  # type: ignore[no-untyped-def]
        for chunk in pcm:
            frame = av.AudioFrame.from_ndarray(chunk, format="s16", layout="mono")
            frame.sample_rate = 48000
            yield frame

    before = threads()
    resampler = Resampler(16000)
    ours = np.concatenate([resampler.resample(f) for f in frames()])
    assert threads() == before  # PyAV's own: one more thread per core, for its lifetime
    pyav = av.AudioResampler(format="s16", layout="mono", rate=16000)
    theirs = np.concatenate([f.to_ndarray().reshape(-1) for frame in frames()
                             for f in pyav.resample(frame)])
    assert np.array_equal(ours, theirs) and ours.size > 3000


@pytest.mark.unit
def test_clock_puts_audio_and_video_of_one_media_time_at_one_send_time():
    clock = MediaClock(origin=100.0, fps=25, delay=0.14)
    for i in (0, 1, 250, 90000):
        k = i * clock.chunks_per_frame
        assert clock.video_send_time(i) == clock.audio_send_time(k)
        assert clock.video_pts(i) / 90000 == clock.audio_pts(k) / 48000
    assert clock.video_index_due(clock.video_send_time(7) - 0.001) == 6
    assert clock.video_index_due(clock.video_send_time(7)) == 7
    assert clock.chunk_index_at(clock.audio_send_time(9) + 0.001) == 10


@pytest.mark.unit
def test_chunks_sent_as_one_packet_leave_at_the_first_ones_time():
    clock = MediaClock(origin=100.0, fps=25, delay=0.14, packet_chunks=2)
    assert clock.audio_send_time(4) == clock.audio_send_time(5) == clock.video_send_time(2)
    assert clock.audio_send_time(6) - clock.audio_send_time(5) == pytest.approx(0.04)
    assert clock.chunk_index_due(clock.audio_send_time(5) + 0.025) == 4
    assert clock.chunk_index_due(clock.audio_send_time(6)) == 6
    # an interruption now cannot unsend chunk 5: it left with chunk 4
    assert clock.chunk_index_at(clock.audio_send_time(4) + 0.001) == 6


async def _pair(sender_track, on_receiver_track):  # type: ignore[no-untyped-def]
    """Two aiortc peers on loopback: ``sender_track`` goes one way, and the receiving
    side's ``on_receiver_track(pc, track)`` runs as the track arrives."""
    import asyncio

    from aiortc import RTCConfiguration, RTCPeerConnection

    sender = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    receiver = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    arrived: asyncio.Future = asyncio.get_running_loop().create_future()

    @receiver.on("track")
    def on_track(track):  # type: ignore[no-untyped-def]
        on_receiver_track(receiver, track)
        arrived.set_result(track)

    sender.addTrack(sender_track)
    await sender.setLocalDescription(await sender.createOffer())
    await receiver.setRemoteDescription(sender.localDescription)
    await receiver.setLocalDescription(await receiver.createAnswer())
    await sender.setRemoteDescription(receiver.localDescription)
    return sender, receiver, await arrived


def _assert_is_the_speech_sent(frames: list[av.AudioFrame], packets: list[bytes]) -> None:
    got = np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(np.float64)
    # The same packets through libopus on their own: what the peer sent.
    reference = av.CodecContext.create("libopus", "r")
    reference.format, reference.layout, reference.sample_rate = "s16", "mono", 48000
    want = np.concatenate([f.to_ndarray().reshape(-1) for p in packets[:got.size // 960 + 50]
                           for f in reference.decode(av.Packet(p))]).astype(np.float64)
    # Decoding starts wherever the first packet came through.
    lag = int(np.argmax(np.correlate(want[:48000], got[:9600], "valid")))
    segment = want[lag:lag + got.size]
    assert np.corrcoef(got[:segment.size], segment)[0, 1] > 0.99


@pytest.mark.e2e
async def test_audio_decoded_on_the_loop_is_the_speech_sent_and_needs_no_thread(speech_wav):
    import threading

    from server.client.speech import EncodedSpeech
    from server.media.audio_ingest import decode_on_loop

    packets = EncodedSpeech.encode_wav(str(speech_wav))
    threads = threading.active_count()
    sender, receiver, track = await _pair(EncodedSpeech(packets), decode_on_loop)
    try:
        frames = [await track.recv() for _ in range(150)]  # 3 s
        # aiortc would hold a decoder thread per receiver for the call's whole length.
        assert threading.active_count() == threads
    finally:
        await sender.close()
        await receiver.close()
    assert all(f.layout.name == "mono" and f.format.name == "s16" and f.sample_rate == 48000
               and f.samples == 960 for f in frames)
    _assert_is_the_speech_sent(frames, packets)


@pytest.mark.e2e
async def test_speech_in_40_ms_packets_is_decoded_whole_as_each_packet_arrives(speech_wav):
    """aiortc's own audio buffer would let the first packet go only once four more had
    come (160 ms of 40 ms packets); decoded on the loop, it is heard on arrival."""
    import asyncio

    from server.client.speech import EncodedSpeech
    from server.media.audio_ingest import decode_on_loop

    packets = EncodedSpeech.encode_wav(str(speech_wav))
    speech = EncodedSpeech(packets)
    speech.frames_per_packet = 2
    sender, receiver, track = await _pair(speech, decode_on_loop)
    try:
        frames = [await track.recv()]
        first_heard = asyncio.get_running_loop().time()
        frames += [await track.recv() for _ in range(74)]  # 3 s
    finally:
        await sender.close()
        await receiver.close()
    assert speech._start is not None and first_heard - speech._start < 0.03
    assert all(f.layout.name == "mono" and f.samples == 1920 for f in frames)
    _assert_is_the_speech_sent(frames, packets)


@pytest.mark.unit
def test_inbound_packets_pass_as_they_arrive_and_late_ones_are_dropped() -> None:
    from aiortc.rtp import RtpPacket

    from server.media.audio_ingest import PacketsOnArrival

    buffer = PacketsOnArrival()
    passed = []
    # Wraps; 1 comes after 2; 2 twice; then the sender numbers afresh from 40000.
    for seq in (65534, 65535, 0, 2, 1, 2, 3, 65535, 40000, 40001):
        packet = RtpPacket(sequence_number=seq, timestamp=seq * 1920)
        packet._data = bytes([seq % 256])  # type: ignore[attr-defined]
        pli, frame = buffer.add(packet)
        assert not pli
        if frame is not None:
            assert frame.data == bytes([seq % 256]) and frame.timestamp == seq * 1920
            passed.append(seq)
    assert passed == [65534, 65535, 0, 2, 3, 40000, 40001]


@pytest.mark.unit
def test_the_resampler_says_what_more_input_will_bring_out_and_batching_changes_nothing():
    """Once running, ``output_after`` is exact (the filter's hold-back is constant), and a
    stream resampled 40 ms at a time comes out the same as 20 ms at a time."""
    pcm = (np.random.default_rng(1).normal(0, 3000, 48000)).astype(np.int16)

    def run(sizes: list[int]) -> tuple[np.ndarray, list[tuple[int, int]]]:
        resampler, pos, out, said = Resampler(16000), 0, [], []
        for n in sizes:
            expected = resampler.output_after(n, 48000)
            frame = av.AudioFrame.from_ndarray(pcm[pos:pos + n].reshape(1, -1), format="s16",
                                               layout="mono")
            frame.sample_rate = 48000
            out.append(resampler.resample(frame))
            said.append((expected, out[-1].size))
            pos += n
        return np.concatenate(out), said

    per_chunk, said = run([960] * 40)
    per_frame, _ = run([1920] * 20)
    assert all(expected == got for expected, got in said[1:]), said
    np.testing.assert_array_equal(per_chunk, per_frame)
