"""Avatars as resources: the shipped one and uploaded portraits (a person's face: with API
keys on, private to the key that uploaded it unless ``?public=true``)."""

from __future__ import annotations

from typing import Any

import aiohttp
import cv2
from aiohttp import BodyPartReader, web

from inference.images import PortraitError
from server.http.app_keys import access_key
from server.http.bodies import read_at_most, read_body
from server.http.errors import fail, shown
from server.media.avatars import DEFAULT_AVATAR, AvatarInUse, UnknownAvatar
from server.worker.api.context import caller, state


async def list_avatars(request: web.Request) -> web.Response:
    return web.json_response({"avatars": state(request).avatars.list(
        request.app[access_key].viewer(request)), "default": DEFAULT_AVATAR})


async def _read_part(part: BodyPartReader, limit: int) -> bytes:
    """A multipart part, refused past ``limit`` bytes (aiohttp's body limit does not apply
    to streamed multipart reads)."""
    data = bytearray()
    while chunk := await part.read_chunk(64 * 1024):
        data += chunk
        if len(data) > limit:
            fail(413, "body_too_large", f"request body exceeds the limit of {limit} bytes")
    return bytes(data)


async def _upload_bytes(request: web.Request) -> tuple[bytes, str | None]:
    limit = state(request).settings.http.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        fail(413, "body_too_large", f"request body exceeds the limit of {limit} bytes")
    if request.content_type.startswith("multipart/"):
        try:
            reader = await request.multipart()
            async for part in reader:
                if isinstance(part, BodyPartReader) and (
                        part.filename or part.name in ("image", "file", "portrait")):
                    return await _read_part(part, limit), part.filename
        except (ValueError, AssertionError, aiohttp.ClientError) as exc:  # aiohttp's own
            fail(400, "bad_multipart", f"the multipart body could not be read: "
                 f"{shown(str(exc), 200)} (a boundary is needed: "
                 "Content-Type: multipart/form-data; boundary=...)")
        fail(400, "missing_image", 'multipart upload needs a file part named "image"')
    data = await read_at_most(request, limit)
    if not data:
        fail(400, "missing_image", "request body is empty: send a JPEG or PNG")
    return data, request.query.get("name")


async def upload_avatar(request: web.Request) -> web.Response:
    """With API keys on, the portrait is the uploading key's alone unless ``?public=true``."""
    owner = caller(request)
    data, name = await read_body(request, _upload_bytes(request))
    public = request.query.get("public", "").lower() in ("1", "true", "yes")
    try:
        avatar = await state(request).avatars.add_upload(data, name, owner=owner,
                                                          public=public)
    except PortraitError as exc:
        status = {"image_too_large": 413, "no_face": 422}.get(exc.code, 400)
        fail(status, exc.code, str(exc))
    return web.json_response(avatar.describe(), status=201)


async def get_avatar(request: web.Request) -> web.Response:
    try:
        return web.json_response(state(request).avatars.get(
            request.match_info["avatar_id"], request.app[access_key].viewer(request)
        ).describe())
    except UnknownAvatar:
        fail(404, "unknown_avatar", f"no avatar {shown(request.match_info['avatar_id'])}")


async def delete_avatar(request: web.Request) -> web.Response:
    """An uploaded portrait forgotten (with API keys on, by a key that uploaded it)."""
    avatar_id = request.match_info["avatar_id"]
    try:
        state(request).avatars.remove(avatar_id, caller(request))
    except UnknownAvatar:
        fail(404, "unknown_avatar", f"no avatar {shown(avatar_id)}")
    except PermissionError:
        fail(403, "shipped_avatar", f"{avatar_id} ships with the server and stays")
    except AvatarInUse:
        fail(409, "avatar_in_use", f"{avatar_id} is in use by a live session; end it first")
    return web.Response(status=204)


async def avatar_image(request: web.Request) -> web.Response:
    """The portrait as the engine sees it (cropped around the face), as PNG."""
    s = state(request)
    try:
        avatar = s.avatars.get(request.match_info["avatar_id"],
                             request.app[access_key].viewer(request))
    except UnknownAvatar:
        fail(404, "unknown_avatar", f"no avatar {shown(request.match_info['avatar_id'])}")
    portrait = next(iter(avatar.prepared.values()))
    ok, png = cv2.imencode(".png", cv2.cvtColor(portrait.image, cv2.COLOR_RGB2BGR))
    return web.Response(body=png.tobytes(), content_type="image/png")


HANDLERS: dict[str, Any] = {"list_avatars": list_avatars, "upload_avatar": upload_avatar,
                            "get_avatar": get_avatar, "delete_avatar": delete_avatar,
                            "avatar_image": avatar_image}
