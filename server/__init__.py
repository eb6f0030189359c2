"""The media server. A module's folder says which process it runs in and what it may import
(``tests/test_imports.py`` holds them to it; ``docs/architecture.md`` draws the picture):

- here, at the top: what every process shares (settings, session costs and specs, load
  measurement, metrics, the engine's settings) and ``python -m server``;
- ``http/``: what the front door and the media workers both serve HTTP with, the one
  table of the API (``http/api.py``) among it;
- ``front_door/``: the front door's process, on the HTTP port: it keeps the others
  running, places new sessions, and sends every other request where it belongs;
- ``worker/``: a media worker's process (or the whole server alone, ``workers.embedded``),
  its handlers of the API in ``worker/api/``;
- ``media/``: a worker's media path: sessions, their audio in, media clock and tracks out;
- ``integrations/``: third-party servers a worker's sessions join (Janus);
- ``client/``: what runs in a caller's process: the reference peer
  (``python -m server.client``), ``SessionClient``, pipecat, the calibration's peers.

The engine side (features, scheduler, engine, the inference process) is ``inference``.
"""
