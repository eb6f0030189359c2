"""Inference: audio features, portrait preparation, the shared scheduler, engines and runtimes."""
