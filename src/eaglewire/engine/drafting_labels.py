"""How a server drafts, as the string labels of a Prometheus info metric, and back.

``eaglewire serve`` exports every request's drafting as ``eaglewire_drafting_info`` (serve/server.py) and
``eaglewire doctor --server`` reads it to walk the chain the server really runs (doctor/served.py): the
label names live here only, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping

from .context_lookup import LookupShape
from .speculative import GenerationConfig


def drafting_labels(drafting: GenerationConfig) -> dict[str, str]:
    """The drafting fields of ``drafting`` (strategy, chain, its confidence stop, its lookups; 0: no lookups)."""
    lookup = drafting.lookup
    return {"strategy": drafting.strategy, "chain_length": str(drafting.chain_length),
            "min_confidence": repr(drafting.min_confidence),
            "lookup_min": str(lookup.min_match) if lookup else "0",
            "lookup_drafts": str(lookup.max_drafts) if lookup else "0",
            "lookup_longest": str(lookup.longest_match) if lookup else "0"}


def drafting_from_labels(labels: Mapping[str, str]) -> GenerationConfig:
    """The config ``drafting_labels`` described (fields it does not carry at their defaults). Raises KeyError
    for a missing label, ValueError for one that is not a number, and the config's own error for a value out
    of range."""
    lookup_min = int(labels["lookup_min"])
    lookup = (LookupShape(min_match=lookup_min, max_drafts=int(labels["lookup_drafts"]),
                          longest_match=int(labels["lookup_longest"])) if lookup_min else None)
    return GenerationConfig(strategy=labels["strategy"], chain_length=int(labels["chain_length"]),
                            min_confidence=float(labels["min_confidence"]), lookup=lookup)
