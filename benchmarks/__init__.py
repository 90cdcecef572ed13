"""Benchmarks for kvfleet: run with `python -m benchmarks.<name>` (e.g. `make bench`)."""
