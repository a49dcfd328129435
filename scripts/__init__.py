"""Benchmarks, load and stress tools and the repository's makers, on shelves (README.md here)."""
