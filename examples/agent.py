"""An agent that speaks through the avatar: it makes a session, says a few sentences with
espeak-ng, each streamed to the server in 100 ms pieces as if a TTS were synthesising it,
and cuts itself off in the middle of the last one, as an agent does when its user starts
talking. It prints the session's events, and how much of the cut sentence was heard.
With ``--listen SECONDS`` it then says whatever viewers type into the web page's text box
(a ``viewer_message`` event), each request cutting off the one before.

Watch it with any viewer of the session, e.g. the web page or the reference client
(espeak-ng speaks: apt-get install espeak-ng; pip install -e '.[examples]'):

    python -m server &                                  # the server, on loopback
    python -m examples.agent http://127.0.0.1:8080 --listen 300   # prints the viewer URL
    python -m server.client http://127.0.0.1:8080 --view SESSION TOKEN --seconds 15
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from inference.tts import espeak
from server.client.session_client import SessionClient

SENTENCES = ["Hello, I am the avatar of an agent.",
             "Everything I say is streamed to the server as it is synthesised.",
             "When you start talking I stop at once, and I know how much of this sentence "
             "you actually heard, so that I can forget the rest of it."]
RATE = 16000


async def synthesised(text: str) -> AsyncIterator[np.ndarray]:
    """``text`` as a TTS would stream it: 100 ms pieces, faster than real time."""
    speech = espeak(text, rate=RATE)
    for start in range(0, speech.size, RATE // 10):
        yield speech[start:start + RATE // 10]
        await asyncio.sleep(0.02)


async def answer_viewers(avatar: SessionClient, seconds: float,
                         listening: asyncio.Event | None = None) -> list[str]:
    """For ``seconds``, say each text a viewer sends, cutting off whatever is being said
    (the person asked for something else); the texts said. ``listening`` is set once
    no message can be missed."""
    said: list[str] = []
    speaking: asyncio.Task[Any] | None = None

    async def listen() -> None:
        nonlocal speaking
        async for event in avatar.events(listening):
            if event["type"] != "viewer_message":
                continue
            if speaking is not None and not speaking.done():
                await avatar.interrupt()
                await speaking
            said.append(event["text"])
            speaking = asyncio.create_task(avatar.speak(synthesised(event["text"]), RATE))

    try:
        await asyncio.wait_for(listen(), seconds)
    except TimeoutError:
        pass
    if speaking is not None:
        await speaking
    return said


async def run(url: str, *, wait_s: float = 3.0, cut_after_s: float = 2.0,
              listen_s: float = 0.0, api_key: str | None = None) -> list[dict[str, Any]]:
    """Speak, cut the last sentence ``cut_after_s`` into it, then answer viewers for
    ``listen_s``; the events seen."""
    seen: list[dict[str, Any]] = []
    async with SessionClient(url, api_key=api_key) as avatar:
        print(json.dumps({"session_id": avatar.session_id, "token": avatar.token,
                          "page": f"{avatar.base_url}/?session={avatar.session_id}"
                                  f"&token={avatar.token}"}), flush=True)

        async def follow() -> None:
            async for event in avatar.events():
                seen.append(event)
                print(json.dumps(event), flush=True)

        follower = asyncio.create_task(follow())
        await asyncio.sleep(wait_s)  # time for a viewer to join
        for text in SENTENCES[:-1]:
            await avatar.speak(synthesised(text), RATE)
        last = asyncio.create_task(avatar.speak(synthesised(SENTENCES[-1]), RATE))
        while not any(e["type"] == "utterance_started" and e["utterance_id"].endswith(
                f"-u{len(SENTENCES)}") for e in seen):
            await asyncio.sleep(0.05)
        await asyncio.sleep(cut_after_s)
        cut = await avatar.interrupt()
        await last
        for utterance in cut["interrupted"]:
            print(f"cut off after {utterance['heard_s']} s of the last sentence", flush=True)
        await asyncio.sleep(0.5)
        if listen_s > 0:
            await answer_viewers(avatar, listen_s)
        follower.cancel()
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.agent", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="the server, e.g. http://127.0.0.1:8080")
    parser.add_argument("--wait", type=float, default=3.0, help="seconds before speaking")
    parser.add_argument("--listen", type=float, default=0.0, metavar="SECONDS",
                        help="then say what viewers type on the web page, for this long")
    parser.add_argument("--api-key", help="one of the server's http.api_keys, if it has any")
    args = parser.parse_args()
    asyncio.run(run(args.url, wait_s=args.wait, listen_s=args.listen, api_key=args.api_key))


if __name__ == "__main__":
    main()
