"""The front door's answers as one host of a cluster: a new session placed on whichever
host has the most room (reserved atomically in Redis), session routes sent to the host
holding them, lists and names across every host, ``GET /cluster`` and draining.

A request another host sent (``X-Sonic-Hop``) is answered from this host's own sessions
(``server.front_door.routes``), so no request is sent on twice."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from urllib.parse import quote

import aiohttp
from aiohttp import web

from server.cluster.host import HOP, RESERVATION
from server.cluster.member import ClusterMember
from server.cluster.records import DRAINING, kind_of
from server.cluster.registry import RedisError
from server.costs import session_cost
from server.front_door.door import FrontDoor, front_door_key
from server.front_door.relay import ask_every, credentials, outgoing, relayed
from server.http.app_keys import access_key
from server.http.errors import ApiError, at_capacity, fail, shown
from server.session_spec import NewSession

log = logging.getLogger(__name__)
#: How long a name is held while its session is being made.
NAME_PENDING_S = 30.0
#: Answers from a chosen host that send the placement on to the next.
NEXT_HOST = frozenset({502, 503, 504})


def clustered(request: web.Request) -> ClusterMember | None:
    """This host's membership, where the request is to be answered for the whole cluster:
    not one another host sent (``X-Sonic-Hop``)."""
    member = request.app[front_door_key].member
    return None if member is None or HOP in request.headers else member


async def place(request: web.Request, spec: NewSession,
                here: Callable[[str | None], Awaitable[web.Response]]) -> web.Response:
    """The session made on the host with the most room for it, its place reserved in
    Redis first so that front doors placing at once cannot overfill a host; a host that
    refuses or does not answer passes it to the next. ``here(reservation)`` makes it on
    this host. With Redis away, this host alone takes it."""
    member = request.app[front_door_key].member
    assert member is not None
    if member.degraded:
        return await here(None)
    kind, cost = kind_of(spec.size, spec.motion_only), session_cost(spec.size, spec.motion_only)
    tried: set[str] = set()
    while True:
        try:
            chosen = await member.registry.reserve(member.candidates(tried), kind, cost,
                                                   uuid.uuid4().hex)
        except (RedisError, OSError):
            return await here(None)
        if chosen is None and member.node not in tried and member.state != DRAINING:
            tried.add(member.node)  # what this host has, as it knows it now, not as
            response = await _answer(here(None))  # published up to a second ago
            if response.status not in NEXT_HOST:
                return response
            continue
        if chosen is None:
            refused = f" ({len(tried)} refused it)" if tried else ""
            at_capacity(f"no host in the cluster has room for another "
                        f"{'motion-only' if spec.motion_only else f'{spec.size}x{spec.size}'} "
                        f"session{refused}")
        node, reservation = chosen
        tried.add(node)
        if node == member.node:
            response = await _answer(here(reservation))
        else:
            response = await _answer(_send(request, member, node, reservation))
        if 200 <= response.status < 300:
            return response  # the host that made it drops the reservation
        try:
            await member.registry.release(node, reservation)
        except (RedisError, OSError):
            pass  # it lapses by itself
        if response.status not in NEXT_HOST:
            return response


async def _answer(making: Awaitable[web.Response]) -> web.Response:
    """A host's answer to a placement, its refusals included, as a response."""
    try:
        return await making
    except ApiError as exc:
        return exc.answer()
    except (OSError, aiohttp.ClientError):
        return web.Response(status=502)


async def _send(request: web.Request, member: ClusterMember, node: str, reservation: str
                ) -> web.Response:
    """The new session's request, as it came, to the host chosen for it."""
    upload = await outgoing(request)
    upload["headers"][RESERVATION] = reservation
    return relayed(*await member.host(node).request(request.method, request.rel_url.raw_path,
                                                    **upload))


async def claim_name(door: FrontDoor, member: ClusterMember, name: str) -> str | None:
    """``name`` held for a session about to be made: a token to settle it by; 409 where a
    live session has it or one is being made with it. A name whose session or host is
    gone is taken over. None: Redis is away, and this host's own check is all there is."""
    try:
        held = await member.registry.named(name)
        if held is not None and (held.startswith("pending:")
                                 or await _name_is_live(door, member, name, held)):
            fail(409, "name_taken", f"a live session is already called {shown(name)}")
        token = f"pending:{uuid.uuid4().hex}"
        if not await member.registry.swap_name(name, held, token, NAME_PENDING_S):
            fail(409, "name_taken", f"a live session is already called {shown(name)}")
        return token
    except (RedisError, OSError):
        return None


async def _name_is_live(door: FrontDoor, member: ClusterMember, name: str,
                        session_id: str) -> bool:
    """Whether the host holding ``session_id`` still has a session called ``name``."""
    node = session_id.split(".", 1)[0]
    path = f"/names/{quote(name, safe='')}"
    if node == member.node:
        answers = await ask_every(door.processes.live_workers(), "GET", path)
        return any(status != 404 for _, status, _, _ in answers)
    if node not in member.table:
        return False
    try:
        status, _, _ = await member.host(node).request("GET", path)
    except (OSError, aiohttp.ClientError):
        return True  # not known to be gone: kept
    return status != 404


async def settle_name(member: ClusterMember, name: str, token: str | None,
                      response: web.Response) -> None:
    """The name given to the session made (its host keeps it alive), or freed if none was."""
    if token is None:
        return
    session_id = None
    if response.status == 201 and isinstance(response.body, bytes):
        session_id = json.loads(response.body).get("session_id")
    try:
        await member.registry.swap_name(name, token, session_id,
                                        member.settings.cluster.lease_s)
    except (RedisError, OSError):
        pass


async def find_name(request: web.Request, here: Callable[[], Awaitable[web.Response]]
                    ) -> web.Response:
    """The host holding the named session answers, wherever it is."""
    member = request.app[front_door_key].member
    assert member is not None
    name = request.match_info["name"]
    try:
        held = await member.registry.named(name)
    except (RedisError, OSError):
        return await here()
    node = held.split(".", 1)[0] if held and not held.startswith("pending:") else None
    if node is None or node not in member.table:
        fail(404, "unknown_name", f"no live session is called {shown(name)}")
    if node == member.node:
        return await here()
    try:
        return relayed(*await member.host(node).request("GET", request.rel_url.raw_path_qs))
    except (OSError, aiohttp.ClientError):
        fail(502, "host_unavailable", f"host {node}, holding {shown(name)}, did not answer")


async def list_sessions(request: web.Request, here: list[dict[str, object]]) -> web.Response:
    """Every host's sessions the caller may see, each with its ``node``; a host that does
    not answer in time is named in ``unreachable``."""
    member = request.app[front_door_key].member
    assert member is not None
    sessions = [{**s, "node": member.node} for s in here]
    unreachable = []
    for node in member.others():
        try:
            status, body, _ = await member.host(node.id).request(
                "GET", "/sessions", headers=credentials(request))
        except (OSError, aiohttp.ClientError):
            status, body = 0, b""
        if status == 200:
            sessions += [{**s, "node": node.id} for s in json.loads(body)["sessions"]]
        else:
            unreachable.append(node.id)
    return web.json_response({"sessions": sessions, "unreachable": unreachable})


async def to_others(request: web.Request, method: str, path: str,
                    sent: dict[str, object]) -> None:
    """The same upload (or its deletion) on every other host, so that a session placed
    anywhere finds its portrait; a host that fails is logged, not the caller's failure."""
    member = request.app[front_door_key].member
    assert member is not None
    for node in member.others():
        host = member.host(node.id)
        headers = {**sent["headers"], "Origin": host.url}  # type: ignore[dict-item]
        try:
            status, body, _ = await host.request(method, path, **{**sent, "headers": headers})
        except (OSError, aiohttp.ClientError) as exc:
            status, body = 0, str(exc).encode()
        if status >= 300 or status == 0:
            log.warning("%s %s on host %s failed: %s %s", method, path, node.id, status,
                        body[:200].decode(errors="replace"))


async def cluster(request: web.Request) -> web.Response:
    """``GET /cluster``: the live hosts, and which one answered."""
    door = request.app[front_door_key]
    request.app[access_key].caller(request)
    if door.member is None:
        return web.json_response({"node": None, "cluster": False, "nodes": []})
    member = door.member
    return web.json_response({"node": member.node, "cluster": True,
                              "redis": "degraded" if member.degraded else "ok",
                              "nodes": [n.shown() for n in member.as_table()]})


async def drain(request: web.Request) -> web.Response:
    """``POST /cluster/drain``: as SIGTERM, this host takes no new session, lets its own
    run on for up to ``cluster.drain_timeout_s``, then leaves the cluster and stops."""
    door: FrontDoor = request.app[front_door_key]
    request.app[access_key].caller(request)
    if door.member is None:
        fail(409, "not_clustered", "this host is not in a cluster (cluster.redis_url)")
    if door.member.state != DRAINING:
        door.start_draining()
    return web.json_response({"node": door.member.node, "state": DRAINING,
                              "sessions": door.sessions(),
                              "drain_timeout_s": door.settings.cluster.drain_timeout_s},
                             status=202)


HANDLERS = {"cluster": cluster, "drain": drain}
