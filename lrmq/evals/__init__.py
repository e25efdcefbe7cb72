"""Benchmark evaluation: the suites of both papers (`python -m lrmq.evaluate`, docs/evaluate.md)."""
