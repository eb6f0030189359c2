"""Avatars: uploaded portraits, prepared per frame size and kept resident in the engine.

Decoding, face finding and cropping run off the event loop. A prepared portrait is
uploaded to the engine once per (avatar, size) and shared by every session using it;
the slot is released when the last of them ends.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from inference.engine import GEOMETRY_NAMES, PreparedPortrait
from inference.images import DEFAULT_AVATAR_PATH
from inference.portrait import PortraitSource, decode_portrait_source, prepare_portrait
from inference.service import Inference
from server.config import AvatarSettings
from server.media.session import AvatarHandle

DEFAULT_AVATAR = "astronaut"


class UnknownAvatar(KeyError):
    pass


class AvatarInUse(Exception):
    pass


@dataclass
class Avatar:
    """An avatar as served: its portrait prepared at every frame side sessions may ask
    for. The upload itself is not kept (a 4000x4000 photo is 48 MB; both portraits, 1 MB)."""

    avatar_id: str
    name: str
    width: int  # the upload's, for the record
    height: int
    prepared: dict[int, PreparedPortrait]
    credit: str | None = None  # who made the portrait, and its licence
    created: float = field(default_factory=time.time)
    #: Uploaded portraits are people's faces: with API keys on, only the keys that
    #: uploaded one see it, unless it was made public. The shipped ones are public.
    public: bool = True
    owners: set[str] = field(default_factory=set)
    shipped: bool = False  # comes with the server: never removed

    def visible_to(self, caller: str | None) -> bool:
        """``caller``: an API key's owner id, or None with keys off (all is visible)."""
        return caller is None or self.public or caller in self.owners

    def describe(self) -> dict[str, Any]:
        h, w = self.height, self.width
        geometry = {str(size): {name: round(float(v), 4) for name, v in
                                zip(GEOMETRY_NAMES, p.geometry, strict=True)}
                    for size, p in self.prepared.items()}
        return {"avatar_id": self.avatar_id, "name": self.name, "credit": self.credit,
                "width": w, "height": h, "public": self.public,
                "created": self.created, "image_url": f"/avatars/{self.avatar_id}/image",
                "geometry": geometry,
                "geometry_source": next(iter(self.prepared.values())).source}


class AvatarStore:
    def __init__(self, inference: Inference, settings: AvatarSettings,
                 sizes: Sequence[int]) -> None:
        self._inference = inference
        self._settings = settings
        self._sizes = tuple(sizes)
        self._avatars: dict[str, Avatar] = {}
        self._slots: dict[tuple[str, int], tuple[int, int]] = {}  # -> (slot, refcount)
        self._lock = asyncio.Lock()

    async def load_default(self) -> Avatar:
        source = await asyncio.to_thread(self._decode, DEFAULT_AVATAR_PATH.read_bytes())
        avatar = await self._add(DEFAULT_AVATAR, "Astronaut", source,
                                 credit="Eileen Collins, NASA portrait, public domain")
        avatar.shipped = True
        return avatar

    async def add_upload(self, data: bytes, name: str | None, *, owner: str | None = None,
                         public: bool = False) -> Avatar:
        """Validate, decode and prepare an upload; raises ``PortraitError`` on bad input.
        With ``owner`` (an API key's id) it is that key's alone unless ``public``; the
        same photo uploaded by another key is theirs too."""
        avatar_id = hashlib.sha256(data).hexdigest()[:16]
        avatar = self._avatars.get(avatar_id)
        if avatar is None:
            source = await asyncio.to_thread(self._decode, data)
            avatar = await self._add(avatar_id, name or avatar_id, source)
            avatar.public = owner is None or public
        else:
            avatar.public = avatar.public or public
        if owner is not None:
            avatar.owners.add(owner)
        return avatar

    def remove(self, avatar_id: str, caller: str | None) -> None:
        """Forget an upload (``caller`` must be one of its uploaders, with keys on); raises
        ``UnknownAvatar``, ``PermissionError`` for a shipped one, ``AvatarInUse``."""
        avatar = self.get(avatar_id, caller)
        if avatar.shipped:
            raise PermissionError(f"{avatar_id} ships with the server")
        if caller is not None and caller not in avatar.owners:
            raise UnknownAvatar(avatar_id)
        if any(a == avatar_id for a, _ in self._slots):
            raise AvatarInUse(avatar_id)
        del self._avatars[avatar_id]

    def _decode(self, data: bytes) -> PortraitSource:
        s = self._settings
        return decode_portrait_source(data, largest=max(self._sizes), expand_ratio=s.expand_ratio,
                                      max_side=s.max_side, max_pixels=s.max_pixels,
                                      max_decoded_bytes=s.max_decoded_mb * 2**20)

    async def _add(self, avatar_id: str, name: str, source: PortraitSource,
                   credit: str | None = None) -> Avatar:
        """Prepare at every size now (a bad portrait fails here), then let the image go."""
        prepared = {}
        for size in self._sizes:
            prepared[size] = await asyncio.to_thread(
                prepare_portrait, source.image, size=size,
                expand_ratio=self._settings.expand_ratio, face=source.face)
        avatar = Avatar(avatar_id, name, source.width, source.height, prepared, credit)
        self._avatars[avatar_id] = avatar
        self._evict()
        return avatar

    def _evict(self) -> None:
        in_use = {avatar_id for avatar_id, _ in self._slots}
        while len(self._avatars) > self._settings.max_avatars:
            idle = [a for a in self._avatars.values()
                    if a.avatar_id not in in_use and a.avatar_id != DEFAULT_AVATAR]
            if not idle:
                return
            del self._avatars[min(idle, key=lambda a: a.created).avatar_id]

    def get(self, avatar_id: str, caller: str | None = None) -> Avatar:
        avatar = self._avatars.get(avatar_id)
        if avatar is None or not avatar.visible_to(caller):
            raise UnknownAvatar(avatar_id)
        return avatar

    def list(self, caller: str | None = None) -> list[dict[str, Any]]:
        return [a.describe() for a in self._avatars.values() if a.visible_to(caller)]

    async def acquire(self, avatar_id: str, size: int) -> AvatarHandle:
        avatar = self.get(avatar_id)
        portrait = avatar.prepared[size]  # every size sessions may ask for
        async with self._lock:
            key = (avatar_id, size)
            slot, refs = self._slots.get(key, (-1, 0))
            if refs == 0:
                slot = await self._inference.prepare(portrait)
            self._slots[key] = (slot, refs + 1)
        return AvatarHandle(avatar_id, slot, size, portrait.image)

    def release(self, handle: AvatarHandle) -> None:
        key = (handle.avatar_id, handle.size)
        slot, refs = self._slots.get(key, (handle.slot, 1))
        if refs <= 1:
            self._slots.pop(key, None)
            self._inference.release(slot)
        else:
            self._slots[key] = (slot, refs - 1)
