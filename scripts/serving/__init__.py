"""Benchmarks and load tests against a running server over HTTP."""
