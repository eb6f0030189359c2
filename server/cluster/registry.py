"""Every Redis read and write of the cluster, and nothing else.

Keys (all under ``sonic:``):

- ``nodes``: the set of host ids that have joined;
- ``node:{id}``: a host's hash (``record``: its ``NodeRecord``; ``state``; ``room:{kind}``),
  expiring ``cluster.lease_s`` after its last renewal: a host whose lease lapses is gone;
- ``resv:{id}``: places reserved on a host by placing front doors and not yet seen in its
  record, scored by when they lapse; each member is ``{token}:{cost}``;
- ``boot:{id}:{boot}``: the URL of a run of a host that joined (kept a week), so its
  sessions are 410 once it is gone rather than 404;
- ``name:{name}``: the session id called ``name`` (or ``pending:{token}`` while one is
  being made), kept alive by its host's renewals.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from server.cluster.records import NodeRecord

__all__ = ["Registry", "RedisError"]

PREFIX = "sonic:"
#: How long a reservation holds a place if its placing door never says how it went.
RESERVATION_S = 15.0
BOOT_KEPT_S = 7 * 24 * 3600
#: Connections one host holds to Redis at most.
CONNECTIONS = 32

#: The placement itself, atomic: of the candidate hosts, the serving one with the most room
#: for a session of this kind, less the places already reserved there, gets the place.
#: KEYS: the candidates' hashes, then their reservation sets; ARGV: kind, cost, member,
#: how long the reservation holds (ms). Returns the chosen candidate's position (1-based).
_RESERVE = """
local n = #KEYS / 2
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cost = tonumber(ARGV[2])
local best, most = 0, 0
for i = 1, n do
  local fields = redis.call('HMGET', KEYS[i], 'state', 'room:' .. ARGV[1])
  if fields[1] == 'serving' and fields[2] then
    redis.call('ZREMRANGEBYSCORE', KEYS[n + i], '-inf', now)
    local held = 0
    for _, m in ipairs(redis.call('ZRANGE', KEYS[n + i], 0, -1)) do
      held = held + tonumber(string.match(m, ':([^:]+)$'))
    end
    local room = tonumber(fields[2]) * cost - held
    if room >= cost * 0.999 and room > most then best, most = i, room end
  end
end
if best == 0 then return false end
redis.call('ZADD', KEYS[n + best], now + tonumber(ARGV[4]), ARGV[3])
redis.call('PEXPIRE', KEYS[n + best], ARGV[4])
return best
"""

#: Set KEYS[1] to ARGV[2] (for ARGV[3] ms) only if it holds ARGV[1] now ('' : nothing).
_SWAP = """
local now = redis.call('GET', KEYS[1])
if (now or '') ~= ARGV[1] then return 0 end
if ARGV[2] == '' then redis.call('DEL', KEYS[1]) else
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) end
return 1
"""

#: Keep KEYS[1] alive for ARGV[2] ms more if it still holds ARGV[1].
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


def _node(node: str) -> str:
    return f"{PREFIX}node:{node}"


def _reservations(node: str) -> str:
    return f"{PREFIX}resv:{node}"


def _name(name: str) -> str:
    return f"{PREFIX}name:{name}"


class Registry:
    def __init__(self, url: str, lease_s: float) -> None:
        # A burst of placements waits its turn for a connection (2 s at most) rather than
        # failing past a pool's limit.
        self.redis = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
            url, max_connections=CONNECTIONS, timeout=2.0, decode_responses=True,
            socket_timeout=2.0, socket_connect_timeout=2.0))
        self.lease_ms = int(lease_s * 1000)
        self._reserve = self.redis.register_script(_RESERVE)
        self._swap = self.redis.register_script(_SWAP)
        self._renew = self.redis.register_script(_RENEW)

    async def close(self) -> None:
        await self.redis.aclose()

    # ---- hosts -------------------------------------------------------------------------
    async def holder_of(self, node: str) -> NodeRecord | None:
        """The live record under ``node``'s id, if any."""
        text = await self.redis.hget(_node(node), "record")
        return NodeRecord.from_json(text) if text else None

    async def publish(self, record: NodeRecord, fulfilled: Sequence[str] = (),
                      names: dict[str, str] | None = None) -> None:
        """This host's record and lease, renewed; the reservations its sessions now fill
        dropped in the same step, so no place is counted twice or not at all; its named
        sessions' names kept."""
        key = _node(record.id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"record": record.to_json(), "state": record.state,
                                    **{f"room:{k}": v for k, v in record.room.items()}})
            pipe.pexpire(key, self.lease_ms)
            pipe.sadd(f"{PREFIX}nodes", record.id)
            pipe.set(f"{PREFIX}boot:{record.id}:{record.boot}", record.url, ex=BOOT_KEPT_S)
            if fulfilled:
                pipe.zrem(_reservations(record.id), *fulfilled)
            for name, session_id in (names or {}).items():
                await self._renew(keys=[_name(name)], args=[session_id, self.lease_ms],
                                  client=pipe)
            await pipe.execute()

    async def nodes(self) -> list[NodeRecord]:
        """Every live host's record; ids whose lease lapsed are dropped from the set."""
        ids = sorted(await self.redis.smembers(f"{PREFIX}nodes"))
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for node in ids:
                pipe.hget(_node(node), "record")
            texts = await pipe.execute()
        gone = [node for node, text in zip(ids, texts, strict=True) if not text]
        if gone:
            await self.redis.srem(f"{PREFIX}nodes", *gone)
        return [NodeRecord.from_json(text) for text in texts if text]

    async def leave(self, node: str) -> None:
        await self.redis.delete(_node(node), _reservations(node))
        await self.redis.srem(f"{PREFIX}nodes", node)

    async def existed(self, node: str, boot: str) -> str | None:
        """The URL of this run of host ``node``, if it ever joined (within a week)."""
        return await self.redis.get(f"{PREFIX}boot:{node}:{boot}")

    # ---- placing -----------------------------------------------------------------------
    async def reserve(self, candidates: Sequence[str], kind: str, cost: float, token: str
                      ) -> tuple[str, str] | None:
        """A place for a session of ``kind`` (costing ``cost``) on the candidate with the
        most room, reserved at once: the host and the reservation's member, or None."""
        if not candidates:
            return None
        member = f"{token}:{cost:.4f}"
        keys = [_node(n) for n in candidates] + [_reservations(n) for n in candidates]
        chosen = await self._reserve(keys=keys, args=[kind, cost, member,
                                                      int(RESERVATION_S * 1000)])
        return (candidates[int(chosen) - 1], member) if chosen else None

    async def release(self, node: str, member: str) -> None:
        await self.redis.zrem(_reservations(node), member)

    async def reserved(self, node: str) -> list[str]:
        return await self.redis.zrange(_reservations(node), 0, -1)

    # ---- names -------------------------------------------------------------------------
    async def named(self, name: str) -> str | None:
        """What ``name`` holds: a session id, ``pending:...``, or None."""
        return await self.redis.get(_name(name))

    async def swap_name(self, name: str, was: str | None, now: str | None,
                        hold_s: float) -> bool:
        """``name`` set to ``now`` (None: freed) only if it holds ``was`` (None: nothing)."""
        return bool(await self._swap(keys=[_name(name)],
                                     args=[was or "", now or "", int(hold_s * 1000)]))
