"""Benchmark and profiling scripts (not shipped inside the packages)."""
