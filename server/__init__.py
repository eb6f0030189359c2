"""The media server: signalling, sessions, audio ingest, media clock and outbound tracks."""
