"""Who may drive the server: with ``http.api_keys`` set, control routes need
``Authorization: Bearer KEY``, and each session belongs to the key that made it (another
key is told it does not exist). Viewers need only their session's token. With no keys
(the default, for loopback) every caller may do everything."""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

from server.config import HttpSettings
from server.http.errors import ApiError


def same_secret(given: object, secret: str) -> bool:
    """Whether ``given`` is ``secret``, in constant time. Compared as UTF-8 bytes: any text
    a client sends, in any alphabet, is only a wrong secret (a str comparison refuses
    anything but ASCII with an exception)."""
    return isinstance(given, str) and hmac.compare_digest(
        given.encode("utf-8", "surrogateescape"), secret.encode("utf-8", "surrogateescape"))


def key_owner(key: str) -> str:
    """What a session records of the key that made it: not the key itself."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class Access:
    def __init__(self, settings: HttpSettings) -> None:
        self._keys = list(settings.api_keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def caller(self, request: web.Request) -> str | None:
        """The owner id of the caller's valid key; None when keys are off; else 401."""
        if not self._keys:
            return None
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and any(same_secret(key.strip(), k) for k in self._keys):
            return key_owner(key.strip())
        raise ApiError(401, "unauthorized", "this route needs an API key: "
                       "Authorization: Bearer KEY (one of http.api_keys)",
                       headers={"WWW-Authenticate": "Bearer"})

    def viewer(self, request: web.Request) -> str | None:
        """As ``caller``, for routes open to all (what is public): None with keys off, the
        key's owner id with a valid key, and "" (sees only what is public) without one."""
        try:
            return self.caller(request)
        except ApiError:
            return ""

    def sees(self, owner: str | None, caller: str | None) -> bool:
        """Whether a caller may see and drive what ``owner`` made."""
        return not self._keys or owner == caller
