"""Many hosts as one server: each runs today's front door, workers and inference processes
unchanged, and they meet in Redis (``cluster.redis_url``), as LiveKit's nodes do.

- ``ids``: session ids that name their host, so a request is routed without asking Redis;
- ``records``: what a host publishes of itself (its load and the room it has);
- ``registry``: every Redis read and write (leases, atomic reservations, names);
- ``member``: this host's life in the cluster (renewing its lease, the table of live hosts
  it routes by, Redis lost and found, draining);
- ``host``: another host's front door as an upstream the relay can send requests to.
"""
