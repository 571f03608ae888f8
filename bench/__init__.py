"""Benchmarks: ``python -m bench.<topic> [--quick]``; never collected by pytest."""
