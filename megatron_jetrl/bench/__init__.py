"""Benchmarks behind `jetrl bench` (each prints FP8/BF16 ratios measured in the same run)."""
