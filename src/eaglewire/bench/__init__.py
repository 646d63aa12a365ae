"""Benchmarks: MT-bench prompts, speculative decoding against its baselines, the cost model."""
