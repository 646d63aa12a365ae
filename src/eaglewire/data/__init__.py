"""Data: conversations in, the target's hidden states out (capture, extract, shards, manifest, probe, samples)."""
