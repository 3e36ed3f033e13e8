"""Reproducible benchmarks of cdc-relay (see bench/README.md)."""
