"""The front door's process: the one HTTP port, in front of the media workers and the
inference processes (``door``), which it keeps running (``supervisor``). It takes a new
session where measured load allows (``admission``, ``placement``, ``calibration``) and
sends every other request where it belongs (``routes``, ``relay``). It never loads the
media path."""
