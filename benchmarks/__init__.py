"""Benchmarks: the only place speed is asserted (docs/design.md, "Benchmarks"). Run ``python -m benchmarks --help``."""
