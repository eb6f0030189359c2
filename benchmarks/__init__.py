"""Benchmarks: scripts that print figures (see BENCHMARKS.md), not timed tests."""
