"""Benchmarks: scripts that print figures (see benchmarks/README.md), not timed tests."""
