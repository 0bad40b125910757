"""Benchmarks: the only place speed is asserted (DESIGN §6). Run ``python -m benchmarks --help``."""
