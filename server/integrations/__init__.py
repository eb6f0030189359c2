"""Third-party servers a worker's sessions join: a Janus VideoRoom (``janus``)."""
