"""Baseline parallelisations the benchmarks compare DHP against (not part of the library)."""
