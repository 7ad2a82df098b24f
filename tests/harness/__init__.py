"""Harnesses shared by the tests and the benchmarks (bench/ scripts import them with the repo root on sys.path)."""
