"""Talking-head models defined in PyTorch (a dev/export dependency, not a server one)."""
