"""``python -m server``: run the media server with the shipped config and CLI overrides."""

from __future__ import annotations

import logging

from aiohttp import web

from server.app import create_app
from server.config import parse_args


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aioice").setLevel(logging.WARNING)
    logging.getLogger("aiortc").setLevel(logging.WARNING)
    web.run_app(create_app(settings), host=settings.http.host, port=settings.http.port,
                print=lambda _: logging.getLogger("server").info(
                    "serving on http://%s:%d", settings.http.host, settings.http.port))


if __name__ == "__main__":
    main()
