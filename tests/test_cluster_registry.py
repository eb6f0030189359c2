"""The cluster's reservations and names against a real Redis: front doors placing at once
never overfill a host, a draining or lapsed host is never chosen, the most room wins, a
host's renewal drops the reservations its sessions now fill, and a name goes to one
session at a time."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator

import pytest
from test_cluster import Redis

from server.cluster.records import DRAINING, SERVING, NodeRecord
from server.cluster.registry import Registry

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def redis():  # type: ignore[no-untyped-def]
    server = Redis()
    yield server
    server.stop()


@pytest.fixture
async def registry(redis: Redis) -> AsyncIterator[Registry]:
    registry = Registry(redis.url, lease_s=2.0)
    await registry.redis.flushdb()
    yield registry
    await registry.close()


def record(node: str, room: int, state: str = SERVING) -> NodeRecord:
    return NodeRecord(node, f"http://{node}:8080", "0badc0de", state, 0, 0, 0.1, room,
                      time.time(), {"256": room, "512": room // 4, "motion": 2 * room})


async def test_front_doors_placing_at_once_never_overfill_a_host(redis: Redis,
                                                                 registry: Registry):
    await registry.publish(record("a", 3))
    await registry.publish(record("b", 5))
    doors = [Registry(redis.url, lease_s=2.0) for _ in range(8)]
    try:
        chosen = await asyncio.gather(*(
            doors[i % 8].reserve(["a", "b"], "256", 1.0, f"t{i}") for i in range(40)))
    finally:
        for door in doors:
            await door.close()
    placed = Counter(c[0] for c in chosen if c is not None)
    assert placed == {"a": 3, "b": 5}, placed
    # Larger sessions cost more of the same room: 512 counts four places.
    await registry.publish(record("c", 8))
    assert await registry.reserve(["c"], "512", 4.0, "big") == ("c", "big:4.0000")
    assert await registry.reserve(["c"], "256", 1.0, "small") is not None
    for i in range(3):
        assert await registry.reserve(["c"], "256", 1.0, f"s{i}") is not None
    assert await registry.reserve(["c"], "256", 1.0, "over") is None  # 4 + 1 + 3 = 8


async def test_the_most_room_wins_and_draining_or_lapsed_hosts_are_never_chosen(
        registry: Registry):
    await registry.publish(record("small", 1))
    await registry.publish(record("large", 4))
    await registry.publish(record("leaving", 9, DRAINING))
    picks = [await registry.reserve(["small", "large", "leaving", "gone"], "256", 1.0,
                                    f"t{i}") for i in range(6)]
    # large until its room less its reservations falls to small's, then either, then none
    assert [p[0] if p else None for p in picks[:3]] == ["large"] * 3
    assert Counter(p[0] for p in picks[3:5] if p) == {"large": 1, "small": 1}
    assert picks[5] is None
    assert [n.id for n in await registry.nodes()] == ["large", "leaving", "small"]
    await asyncio.sleep(2.2)  # their leases lapse
    assert await registry.nodes() == []
    assert await registry.reserve(["small", "large"], "256", 1.0, "late") is None


async def test_a_renewal_drops_the_reservations_its_sessions_now_fill(registry: Registry):
    await registry.publish(record("a", 2))
    first = await registry.reserve(["a"], "256", 1.0, "one")
    second = await registry.reserve(["a"], "256", 1.0, "two")
    assert first and second and await registry.reserve(["a"], "256", 1.0, "three") is None
    # The host made the first session: its record now shows one room fewer, and in the same
    # step the reservation goes, so the session is counted once.
    await registry.publish(record("a", 1), fulfilled=[first[1]])
    assert await registry.reserved("a") == [second[1]]
    assert await registry.reserve(["a"], "256", 1.0, "three") is None
    await registry.release("a", second[1])  # the second host refused: released at once
    assert await registry.reserve(["a"], "256", 1.0, "three") is not None


async def test_a_name_goes_to_one_session_at_a_time(registry: Registry):
    claims = await asyncio.gather(*(registry.swap_name("lobby", None, f"pending:{i}", 5.0)
                                    for i in range(10)))
    assert claims.count(True) == 1
    winner = f"pending:{claims.index(True)}"
    assert await registry.named("lobby") == winner
    assert not await registry.swap_name("lobby", "pending:other", "x.12345678.w0-1", 5.0)
    assert await registry.swap_name("lobby", winner, "x.12345678.w0-1", 1.0)
    # Its host's renewals keep it; without them it lapses and is free again.
    await registry.publish(record("x", 1), names={"lobby": "x.12345678.w0-1"})
    assert await registry.redis.pttl("sonic:name:lobby") > 1500
    await asyncio.sleep(2.2)
    assert await registry.named("lobby") is None
