"""Process harnesses shared by tests and benchmarks (importable from bench/ with the repo root on sys.path)."""
