"""This host's life in the cluster: it joins, renews its lease each second with what it
measures of itself, keeps the table of live hosts it routes by, carries on alone while
Redis is away, and drains and leaves when told to.

Requests are routed from the table as last read, never by asking Redis on the way: a
session's id names its host (``ids``), so running sessions keep working while Redis is
briefly lost. Only placing a new session, and the names, need Redis itself."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from server.cluster.host import Host
from server.cluster.ids import SessionId, host_prefix, new_boot
from server.cluster.records import DRAINING, SERVING, NodeRecord
from server.cluster.registry import RedisError, Registry
from server.config import Settings

log = logging.getLogger(__name__)
#: How often a host renews its lease and reads the others'.
RENEW_S = 1.0
#: ... and how soon after a change here, at the soonest.
RENEW_SOONEST_S = 0.05


@dataclass(frozen=True)
class Standing:
    """What a host measures of itself each second, for its record."""

    sessions: int
    motion_sessions: int
    load: float
    session_capacity: int
    room: dict[str, int]
    names: dict[str, str]  # its named sessions: name to session id
    engine_load: float
    cores_per_session: float


def redis_address(url: str) -> str:
    """The Redis URL as a log line may show it: without its password."""
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


async def can_join(settings: Settings) -> str | None:
    """Why this host cannot join its cluster, in one line (Redis unreachable, or its node
    id held by a live host at another URL), or None."""
    url = settings.cluster.redis_url
    registry = Registry(url, settings.cluster.lease_s)
    try:
        holder = await registry.holder_of(settings.cluster.node())
    except (RedisError, OSError) as exc:
        return f"cannot reach the cluster's Redis at {redis_address(url)}: {exc}"
    finally:
        with contextlib.suppress(RedisError, OSError):
            await registry.close()
    if holder is not None and holder.url != settings.advertise_url:
        return (f"cluster.node_id={holder.id!r} is held by a live host at {holder.url}; "
                "give this host another --node-id")
    return None


class Where(enum.Enum):
    HERE = "here"  # this host holds it (or would, were it alive)
    THERE = "there"  # another live host does
    LOST = "lost"  # a host, or a run of one, that is gone
    NOWHERE = "nowhere"  # no host ever made such an id


class ClusterMember:
    def __init__(self, settings: Settings, measure: Callable[[], Awaitable[Standing]]) -> None:
        c = settings.cluster
        self.settings = settings
        self.node = c.node()
        self.boot = new_boot()
        self.prefix = host_prefix(self.node, self.boot)
        self.url = settings.advertise_url
        self.registry = Registry(c.redis_url, c.lease_s)
        self.state = SERVING
        self.degraded = False
        self.started = time.time()
        #: The live hosts as last read (this one included), and every run of a host seen.
        self.table: dict[str, NodeRecord] = {}
        self._seen: dict[tuple[str, str], str] = {}  # each run of a host seen: its URL
        self._lost: dict[tuple[str, str], float] = {}  # ... found gone, and when
        self._hosts: dict[str, Host] = {}
        self._fulfilled: list[str] = []
        self._measure = measure
        self.left = asyncio.Event()
        self._changed = asyncio.Event()

    # ---- joining and renewing ----------------------------------------------------------
    async def join(self) -> None:
        """Takes this host's place (``can_join`` said it may), with a fresh boot: a
        previous run's sessions are gone, and answer 410."""
        await self.renew()
        log.info("joined the cluster as %s (%s), %d host(s) live", self.node, self.url,
                 len(self.table))

    async def record(self) -> tuple[NodeRecord, dict[str, str]]:
        standing = await self._measure()
        return NodeRecord(self.node, self.url, self.boot, self.state, standing.sessions,
                          standing.motion_sessions, standing.load, standing.session_capacity,
                          self.started, standing.room, standing.engine_load,
                          standing.cores_per_session), standing.names

    async def renew(self) -> None:
        fulfilled, self._fulfilled = self._fulfilled, []
        record, names = await self.record()
        try:
            await self.registry.publish(record, fulfilled, names)
            nodes = await self.registry.nodes()
        except (RedisError, OSError):
            self._fulfilled = fulfilled + self._fulfilled  # dropped when Redis is back
            self.table[self.node] = record
            raise
        self.table = {n.id: n for n in nodes}
        self.table[self.node] = record
        self._seen.update(((n.id, n.boot), n.url) for n in nodes)

    async def run(self) -> None:
        """Renews each second, and soon after a session here is made or ended; Redis lost
        or found is said once, not at every renewal."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), RENEW_S)
            await asyncio.sleep(RENEW_SOONEST_S)  # changes close together: one renewal
            self._changed.clear()
            try:
                await self.renew()
            except (RedisError, OSError) as exc:
                if not self.degraded:
                    log.warning("lost Redis at %s (%s): running sessions go on; new ones are "
                                "placed on this host alone until it is back",
                                redis_address(self.settings.cluster.redis_url), exc)
                self.degraded = True
            else:
                if self.degraded:
                    log.info("Redis at %s is back: placing across the cluster again",
                             redis_address(self.settings.cluster.redis_url))
                self.degraded = False

    async def leave(self) -> None:
        """Out of the cluster at once (the others need not wait for the lease to lapse)."""
        if not self.left.is_set():
            with contextlib.suppress(RedisError, OSError):
                await self.registry.leave(self.node)
            self.left.set()
        await self.close()

    async def close(self) -> None:
        for host in self._hosts.values():
            await host.close()
        self._hosts.clear()
        with contextlib.suppress(RedisError, OSError):
            await self.registry.close()

    # ---- routing -----------------------------------------------------------------------
    def host(self, node: str, url: str | None = None) -> Host:
        """The upstream for host ``node`` at its advertised URL (made once; a connection in
        use, a relayed event stream say, is never closed under it while the host lives)."""
        url = url or self.table[node].url
        if node not in self._hosts or self._hosts[node].url != url:
            self._hosts[node] = Host(node, url, self.node,
                                     self.settings.cluster.forward_timeout_s)
        return self._hosts[node]

    async def where(self, session: SessionId, *, hop: bool) -> tuple[Where, Host | None]:
        """Which host holds the session, and the upstream to reach it there. A request that
        came from another host (``hop``) is answered from this one's own sessions, never
        sent on. A host missing from the table is gone only if it does not answer either:
        a Redis that restarted has forgotten every host for a second, not lost them."""
        key = (session.node or "", session.boot or "")
        if session.node is None or key == (self.node, self.boot):
            return Where.HERE, None
        live = self.table.get(session.node)
        if hop:
            return Where.NOWHERE, None
        if live is not None and live.boot == session.boot:
            return Where.THERE, self.host(session.node)
        url = self._seen.get(key)
        if url is None:
            try:
                url = await self.registry.existed(*key)
            except (RedisError, OSError):
                url = None
        if url is None:
            return Where.NOWHERE, None
        if live is not None or key in self._lost and \
                time.monotonic() - self._lost[key] < self.settings.cluster.lease_s:
            return Where.LOST, None  # restarted as another run, or just found gone
        host = self.host(session.node, url)
        if await host.answers():
            return Where.THERE, host
        self._lost[key] = time.monotonic()
        return Where.LOST, None

    def others(self) -> list[NodeRecord]:
        return [n for n in self.table.values() if n.id != self.node]

    # ---- placing -----------------------------------------------------------------------
    def candidates(self, tried: set[str]) -> list[str]:
        """Serving hosts not yet tried: this one first (no hop where rooms tie), then the
        others in a random order, so ties spread."""
        others = [n.id for n in self.others() if n.state == SERVING and n.id not in tried]
        random.shuffle(others)
        mine = [self.node] if self.state == SERVING and self.node not in tried else []
        return mine + others

    def fulfilled(self, member: str) -> None:
        """A reservation on this host that one of its sessions now fills: dropped at the
        next renewal, in the same step that counts the session."""
        self._fulfilled.append(member)
        self.changed()

    def changed(self) -> None:
        """Sessions here were made or ended: the others should know soon."""
        self._changed.set()

    # ---- draining ----------------------------------------------------------------------
    async def drain(self, sessions: Callable[[], int]) -> None:
        """No new session placed here; the running ones go on until they end or
        ``cluster.drain_timeout_s`` passes; then this host leaves the cluster."""
        if self.state == DRAINING:
            await self.left.wait()
            return
        self.state = DRAINING
        timeout = self.settings.cluster.drain_timeout_s
        log.info("draining: no new sessions here; %d running may go on for up to %.0f s",
                 sessions(), timeout)
        with contextlib.suppress(RedisError, OSError):
            await self.renew()
        deadline = time.monotonic() + timeout
        while sessions() and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        with contextlib.suppress(RedisError, OSError):
            await self.registry.leave(self.node)
        log.info("drained (%d session(s) still running); left the cluster", sessions())
        self.left.set()

    def as_table(self) -> list[NodeRecord]:
        return sorted(self.table.values(), key=lambda n: n.id)
