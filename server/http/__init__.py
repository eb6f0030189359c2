"""What the front door and the media workers both serve HTTP with: the one table of the
API (``api``), the new session's request read once (``new_session``), middleware, bodies,
errors, access by API key, and the answers every process gives alike (``common``)."""
