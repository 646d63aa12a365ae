"""What numbers.tensors matches: the stored tensors of a dataset, eaglewire's own or another stack's.

Either way it is a list of (row, label) pairs, one per stored tensor (the label is the capture point
the data takes it for), the samples, and a reader of one sample's leading tokens; the tensor match
itself does not care which stack wrote them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from ..data.manifest import Manifest
from ..data.samples import SampleRef
from ..data.shards import hidden_key
from .state import CheckState


@dataclass(frozen=True)
class StoredTensors:
    labels: list[tuple[str, str]]  # (row name, the capture point the data takes it for)
    refs: list[SampleRef]
    read: Callable[[SampleRef, int], dict[str, torch.Tensor]]  # a sample's first tokens: row -> [length, H]
    where: Callable[[SampleRef], str]  # the file a sample is stored in
    files: str = "shards"  # what those files are called
    stack: str | None = None  # another stack's dataset: its name and version
    kept_as: dict[str, str] = field(default_factory=dict)  # row -> where that stack keeps it


def stored_labels(manifest: Manifest) -> list[tuple[str, str]]:
    """(row name, shard label) for every stored tensor: the aux points in wiring order, then final."""
    wiring = manifest.wiring
    return [*((f"aux[{i}] {p}", str(p)) for i, p in enumerate(wiring.aux)), (f"teacher {wiring.teacher}", str(wiring.teacher))]


def stored_tensors(st: CheckState) -> StoredTensors:
    if st.foreign_data is not None:
        data = st.foreign_data
        rows = {f"{e.name} {e.claim}": e for e in data.entries}

        def read_foreign(ref: SampleRef, length: int) -> dict[str, torch.Tensor]:
            entries = data.read(ref, length)
            return {row: entries[e.name] for row, e in rows.items()}

        return StoredTensors([(row, str(e.claim)) for row, e in rows.items()], data.refs, read_foreign, data.location,
                             "files", data.source, {row: e.name for row, e in rows.items()})
    labels, folder = stored_labels(st.manifest), st.cfg.data

    def read_shard(ref: SampleRef, length: int) -> dict[str, torch.Tensor]:
        with safe_open(str(folder / ref.shard), framework="pt") as handle:
            return {row: handle.get_slice(hidden_key(label))[ref.start: ref.start + length] for row, label in labels}

    return StoredTensors(labels, st.samples.refs, read_shard, lambda ref: str(ref.shard))
