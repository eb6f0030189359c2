"""``python -m server``: run the media server with the shipped config and CLI overrides."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import sys

from inference.child_process import LOG_FORMAT
from server.cluster.member import can_join
from server.config import parse_args
from server.front_door.app import create_front_door
from server.http.serving import serve
from server.worker.app import create_app


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=LOG_FORMAT)
    for noisy in ("aioice", "aiortc"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    log = logging.getLogger("server")
    for section, values in settings.effective().items():
        log.info("settings [%s] %s", section,
                 " ".join(f"{key}={value!r}" for key, value in values.items()))
    if not settings.http.api_keys and not _loopback(settings.http.host):
        log.warning("listening on %s with no http.api_keys: anyone who can reach it may "
                    "create, drive and end sessions; set SONIC_API_KEYS", settings.http.host)
    if settings.cluster.redis_url:
        problem = asyncio.run(can_join(settings))
        if problem:
            log.error("%s", problem)
            sys.exit(1)
    app = create_app(settings) if settings.workers.embedded else create_front_door(settings)
    serve(app, settings.http, lambda: log.info("serving on http://%s:%d", settings.http.host,
                                               settings.http.port))


if __name__ == "__main__":
    main()
