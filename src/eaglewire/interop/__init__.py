"""Interop: reading and writing the drafter folders of other stacks (SGLang, vLLM, speculators, SpecForge, EAGLE)."""
