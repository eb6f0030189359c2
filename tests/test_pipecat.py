"""The pipecat integration (issue 12): a real pipecat pipeline, whose TTS is espeak-ng,
speaks through a hosted session of a real server on loopback; its interruption is the
session's barge-in; viewers attach with the URL it hands out; an unreachable server is a
clear error at start, not a hang."""

from __future__ import annotations

import asyncio
import shutil
import time
from urllib.parse import parse_qs, urlparse

import aiohttp
import pytest
from conftest import free_port
from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InterruptionFrame,
    OutputTransportMessageUrgentFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineWorker
from pipecat.workers.runner import WorkerRunner
from test_hosted_sessions import _follow
from test_webrtc_session import _mouth_box, assert_mouth_follows_speech

from server.client.peer import run_session
from server.client.pipecat import MESSAGE_TYPE, EspeakTTSService, SonicAvatar, SonicSession

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(shutil.which("espeak-ng") is None,
                                reason="espeak-ng is not installed (apt-get install espeak-ng)")]


def _pipeline(avatar: SonicAvatar) -> tuple[PipelineWorker, WorkerRunner, list[Frame]]:
    """espeak-ng TTS -> the avatar, run as pipecat runs a bot; the frames that reach the
    end of the pipeline (where the output transport would be) are collected."""
    worker = PipelineWorker(Pipeline([EspeakTTSService(), avatar]), idle_timeout_secs=None)
    worker.set_reached_downstream_filter((OutputTransportMessageUrgentFrame, TTSAudioRawFrame))
    reached: list[Frame] = []

    @worker.event_handler("on_frame_reached_downstream")
    async def on_frame(worker: PipelineWorker, frame: Frame) -> None:
        reached.append(frame)

    return worker, WorkerRunner(handle_sigint=False), reached


async def test_a_pipeline_speaks_through_a_session_that_a_viewer_watches(server):
    avatar = SonicAvatar(server.url)
    worker, runner, reached = _pipeline(avatar)
    ready: asyncio.Future[SonicSession] = asyncio.get_running_loop().create_future()

    @avatar.event_handler("on_session_ready")
    async def on_ready(avatar: SonicAvatar, session: SonicSession) -> None:
        ready.set_result(session)

    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())
    session = await asyncio.wait_for(ready, 20)
    # The viewer attaches with what the viewer URL carries, as the web page does.
    query = parse_qs(urlparse(session.viewer_url).query)
    view = (query["session"][0], query["token"][0])
    assert view == (session.session_id, session.token)
    events: list[dict] = []
    async with aiohttp.ClientSession() as http:
        async with http.get(session.viewer_url) as response:
            assert response.status == 200 and "html" in response.content_type
        following = asyncio.create_task(
            _follow(http, f"{server.url}/sessions/{session.session_id}/events", events))
        viewer = asyncio.create_task(run_session(server.url, "", seconds=9.0, view=view))
        await asyncio.sleep(2.0)  # connected, and a second of the avatar at rest
        spoken_at = time.monotonic()
        await worker.queue_frames([TTSSpeakFrame("Hello, I am the avatar of a pipecat "
                                                 "agent, and I speak what it says."),
                                   EndFrame()])
        await asyncio.wait_for(running, 30)  # ends once the avatar has said it all
        finished_s = time.monotonic() - spoken_at
        async with http.get(f"{server.url}/sessions/{session.session_id}") as response:
            assert response.status == 404  # the session it made went with the pipeline
        await asyncio.wait_for(following, 5)
        received = await asyncio.wait_for(viewer, 15)

    # The transport was handed the viewer URL, and the TTS audio went on to it.
    (message,) = [f.message for f in reached if isinstance(f, OutputTransportMessageUrgentFrame)
                  and isinstance(f.message, dict) and f.message.get("type") == MESSAGE_TYPE]
    assert message == session.as_message()
    tts = [f for f in reached if isinstance(f, TTSAudioRawFrame)]
    spoken_s = sum(f.num_frames / f.sample_rate for f in tts)
    assert spoken_s > 2.0
    # The session played it as one utterance, start to end, at real time.
    kinds = [e["type"] for e in events]
    assert kinds == ["utterance_started", "utterance_ended"], kinds
    started, ended = events
    assert started["utterance_id"] == ended["utterance_id"]
    assert ended["media_time_s"] - started["media_time_s"] == pytest.approx(spoken_s, abs=0.1)
    assert spoken_s < finished_s < spoken_s + 5.0
    # The viewer saw and heard it: video throughout, the speech, and the mouth moving.
    assert received.video_fps() >= 20.0
    assert_mouth_follows_speech(received, _mouth_box(server, 256))


async def test_an_interruption_cuts_the_avatar_off_and_it_speaks_on(server):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.url}/sessions", json={}) as response:
            created = await response.json()
            assert response.status == 201, created
        session_id = created["session_id"]
        events: list[dict] = []
        following = asyncio.create_task(
            _follow(http, f"{server.url}/sessions/{session_id}/events", events))
        # An existing session: the avatar drives it and leaves it running.
        avatar = SonicAvatar(server.url, session_id=session_id, token=created["token"],
                             send_session_message=False)
        worker, runner, reached = _pipeline(avatar)
        answers: list[dict] = []
        avatar.add_event_handler("on_interrupted", lambda a, answer: answers.append(answer))
        await runner.add_workers(worker)
        running = asyncio.create_task(runner.run())

        async def until(check, what: str, seconds: float) -> float:  # type: ignore[no-untyped-def]
            deadline = time.monotonic() + seconds
            while not check():
                if time.monotonic() > deadline:
                    pytest.fail(f"no {what} within {seconds} s: {events}")
                await asyncio.sleep(0.02)
            return time.monotonic()

        await worker.queue_frame(TTSSpeakFrame(
            "Let me tell you a rather long story about a lighthouse keeper, who counted "
            "every ship that passed his rock for forty years."))
        await until(lambda: events, "speech", 20)
        assert events[0]["type"] == "utterance_started"
        await asyncio.sleep(1.5)
        cut_at = time.monotonic()
        await worker.queue_frame(InterruptionFrame())
        seen_at = await until(lambda: any(e["type"] == "interrupted" for e in events),
                              "interrupt", 3.0)
        await until(lambda: answers, "answer to the interrupt", 3.0)
        # Then it speaks again, to the end, and the pipeline ends.
        await worker.queue_frames([TTSSpeakFrame("Sorry, go on."), EndFrame()])
        await asyncio.wait_for(running, 30)
        async with http.get(f"{server.url}/sessions/{session_id}") as response:
            assert response.status == 200  # not its session: left running
        async with http.delete(f"{server.url}/sessions/{session_id}") as response:
            assert response.status == 204
        await asyncio.wait_for(following, 5)

    assert seen_at - cut_at < 1.0  # the session heard of the cut at once
    kinds = [e["type"] for e in events]
    assert kinds == ["utterance_started", "interrupted", "utterance_started",
                     "utterance_ended"], kinds
    first, second = events[0]["utterance_id"], events[2]["utterance_id"]
    (cut,) = events[1]["interrupted"]
    assert cut["utterance_id"] == first and 1.0 < cut["heard_s"] < 3.0
    assert answers == [avatar.last_interrupt] and answers[0]["interrupted"] == [cut]
    assert events[3]["utterance_id"] == second != first


async def test_an_unreachable_server_is_a_clear_error_at_start_not_a_hang():
    with pytest.raises(ValueError, match="both session_id and token"):
        SonicAvatar("http://127.0.0.1:1", session_id="w0-x")
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    avatar = SonicAvatar(url)
    worker, runner, reached = _pipeline(avatar)
    errors: list[ErrorFrame] = []

    @worker.event_handler("on_pipeline_error")
    async def on_error(worker: PipelineWorker, frame: ErrorFrame) -> None:
        errors.append(frame)

    await runner.add_workers(worker)
    await worker.queue_frames([TTSSpeakFrame("Is anyone there?"), EndFrame()])
    started = time.monotonic()
    await asyncio.wait_for(runner.run(), 20)
    assert time.monotonic() - started < 10
    (error,) = [e for e in errors if e.processor is avatar]
    assert f"cannot reach the Sonic media server at {url}" in error.error
    assert not avatar.is_usable and avatar.session is None
    # The rest of the pipeline ran on: the speech still reached the transport.
    assert any(isinstance(f, TTSAudioRawFrame) for f in reached)


async def test_the_example_pipecat_agent_speaks_and_is_cut_off(server):
    from examples.pipecat_agent import SENTENCES, run

    answer = await asyncio.wait_for(run(server.url, wait_s=0.2, cut_after_s=1.0), 40)
    assert answer is not None
    (cut,) = answer["interrupted"]
    assert cut["utterance_id"].endswith(f"-u{len(SENTENCES)}")  # the last sentence
    assert 0.8 < cut["heard_s"] < 2.5
