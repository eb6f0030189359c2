"""A pipecat pipeline that speaks through the avatar: its TTS (espeak-ng here, offline)
is streamed into a hosted session by ``server.client.pipecat.SonicAvatar``, and an interruption
cuts the avatar off mid-sentence, as when the user starts talking. A real bot puts the
avatar between its TTS and its transport's output; this one has no transport, so it
prints the viewer URL instead of sending it to a client.

    pip install -e '.[pipecat]'                                   # pipecat-ai
    python -m server &                                            # the server, on loopback
    python -m examples.pipecat_agent http://127.0.0.1:8080 --wait 10   # open the URL
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from pipecat.frames.frames import EndFrame, InterruptionFrame, TTSSpeakFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineWorker, ProcessorUnusablePolicy
from pipecat.workers.runner import WorkerRunner

from server.client.pipecat import EspeakTTSService, SonicAvatar, SonicAvatarError, SonicSession

SENTENCES = ["Hello, I am the avatar of a pipecat agent.",
             "When you interrupt me I stop at once, mid sentence, and the server tells "
             "the agent how much of what I said you actually heard."]


async def run(url: str, *, wait_s: float = 3.0, cut_after_s: float = 2.0,
              sentences: list[str] = SENTENCES, api_key: str | None = None
              ) -> dict[str, Any] | None:
    """Say ``sentences``, interrupt the last one ``cut_after_s`` into it; the server's
    answer to the interruption (what was cut, and how much of it was heard)."""
    avatar = SonicAvatar(url, api_key=api_key)
    worker = PipelineWorker(Pipeline([EspeakTTSService(), avatar]), idle_timeout_secs=None,
                            # No avatar, no point: end at once if the server is not there.
                            processor_unusable_policy=ProcessorUnusablePolicy.CANCEL)
    ready: asyncio.Future[SonicSession] = asyncio.get_running_loop().create_future()
    started: list[str] = []

    @avatar.event_handler("on_session_ready")
    async def on_session_ready(avatar: SonicAvatar, session: SonicSession) -> None:
        print(json.dumps(session.as_message()), flush=True)  # a transport gets this too
        ready.set_result(session)

    @avatar.event_handler("on_session_event")
    async def on_session_event(avatar: SonicAvatar, event: dict[str, Any]) -> None:
        print(json.dumps(event), flush=True)
        if event["type"] == "utterance_started":
            started.append(event["utterance_id"])

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())
    await asyncio.wait([ready, running], return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        raise SonicAvatarError(f"the avatar could not start: is the server at {url} up?")
    await asyncio.sleep(wait_s)  # time for a viewer to join
    await worker.queue_frames([TTSSpeakFrame(text) for text in sentences])
    while len(started) < len(sentences) and not running.done():
        await asyncio.sleep(0.05)
    await asyncio.sleep(cut_after_s)
    await worker.queue_frame(InterruptionFrame())  # what a user's turn starting pushes
    while avatar.last_interrupt is None and not running.done():
        await asyncio.sleep(0.05)
    await worker.queue_frame(EndFrame())
    await running
    return avatar.last_interrupt


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.pipecat_agent", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="the server, e.g. http://127.0.0.1:8080")
    parser.add_argument("--wait", type=float, default=3.0, help="seconds before speaking")
    parser.add_argument("--api-key", help="one of the server's http.api_keys, if it has any")
    args = parser.parse_args()
    answer = asyncio.run(run(args.url, wait_s=args.wait, api_key=args.api_key))
    for cut in (answer or {}).get("interrupted", []):
        print(f"cut off after {cut['heard_s']} s of {cut['utterance_id']}", flush=True)


if __name__ == "__main__":
    main()
