"""An application's handle on a session it drives: speak into it, interrupt it,
follow its events, end it (``POST /sessions`` and the routes under it)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import numpy as np

from server.client.http import post_once_ready


class SessionClient:
    """An application's handle on a session it drives (``POST /sessions``): speak into it,
    as a whole WAV or as PCM chunks while a TTS makes them, interrupt it, follow its
    events, end it. Use as ``async with SessionClient(url) as avatar: ...``."""

    def __init__(self, base_url: str, *, api_key: str | None = None,
                 avatar: str | None = None, size: int | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._create = {k: v for k, v in (("avatar", avatar), ("size", size)) if v}
        self._http: aiohttp.ClientSession | None = None
        self.session_id = self.token = ""

    async def __aenter__(self) -> SessionClient:
        self._http = aiohttp.ClientSession(headers=self._headers)
        status, answer = await post_once_ready(self._http, self.base_url + "/sessions",
                                               self._create)
        if status != 201:
            await self._http.close()
            raise RuntimeError(f"POST /sessions: {status} {answer}")
        self.session_id, self.token = answer["session_id"], answer["token"]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._http is not None
        async with self._http.delete(self.base_url + self._path()):
            pass
        await self._http.close()

    def _path(self, suffix: str = "") -> str:
        return f"/sessions/{self.session_id}{suffix}"

    async def _call(self, method: str, path: str, status: int, **kwargs: Any) -> Any:
        assert self._http is not None, "use SessionClient in async with"
        async with self._http.request(method, self.base_url + path, **kwargs) as response:
            answer = await response.json()
            if response.status != status:
                raise RuntimeError(f"{method} {path}: {response.status} {answer}")
            return answer

    async def speak_wav(self, wav: bytes) -> dict[str, Any]:
        """Queue a WAV; answered once it has all arrived (it plays at real time)."""
        return await self._call("POST", self._path("/speech"), 200, data=wav,
                                headers={"Content-Type": "audio/wav"})

    async def speak(self, chunks: Any, rate: int) -> dict[str, Any]:
        """Stream int16 mono chunks at ``rate`` Hz (an async iterable, e.g. a TTS as it
        synthesises) as one utterance; the server reads them no faster than it plays."""
        async def body() -> Any:
            async for chunk in chunks:
                yield np.asarray(chunk, np.int16).astype(">i2").tobytes()

        return await self._call("POST", self._path("/speech"), 200, data=body(),
                                headers={"Content-Type": f"audio/L16;rate={rate};channels=1"})

    async def interrupt(self) -> dict[str, Any]:
        """Barge-in: which utterances were cut, and how much of each was heard."""
        return await self._call("POST", self._path("/interrupt"), 200)

    async def events(self, following: asyncio.Event | None = None) -> Any:
        """The session's events (dicts) until it ends; ``following`` is set once the
        stream is open, so that no event from then on can be missed."""
        assert self._http is not None
        async with self._http.get(self.base_url + self._path("/events"),
                                  timeout=aiohttp.ClientTimeout(total=None)) as response:
            if following is not None:
                following.set()
            async for line in response.content:
                if line.startswith(b"data: "):
                    yield json.loads(line[6:])
