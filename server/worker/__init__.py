"""A media worker's process (``main``): its whole server (``app``), the API's handlers
(``api/``), and what the front door knows of it: its handle (``handle``) and its load
report (``report``)."""
