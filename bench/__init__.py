"""Benchmarks that print ratios; run each as ``python -m bench.<name>``."""
