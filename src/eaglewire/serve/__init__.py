"""Serving: an OpenAI-compatible HTTP server over the engine, with a scheduler that batches requests."""
