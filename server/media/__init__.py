"""A media worker's media path: sessions (``session``, ``sessions``), where their speech
comes from (``audio_sources``, ``audio_ingest``, ``speech``), the media clock, the
outbound tracks and their encoders, WebRTC peers, events, recording and avatars. It knows
nothing of the processes around it."""
