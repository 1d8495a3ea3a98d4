"""Benchmarks run by `workbench bench ...`: timings only; correctness lives in
the tests."""
