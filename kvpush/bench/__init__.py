"""Benchmark tools: measure connectors as operators run them."""
