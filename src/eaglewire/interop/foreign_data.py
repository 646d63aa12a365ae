"""Other stacks' hidden-state datasets, read as samples the doctor's tensor match can check.

Each stack stores, per sample, the token ids and a list of hidden states, and takes each entry for a
given tensor of the target; nothing in the files says which. The layouts, read from the released
wheels:

speculators 0.9.0 (``speculators/data_generation/offline.py``, ``train/data.py``): ``hidden_states/
hs_{i}.safetensors`` (or the files alone) with ``token_ids`` [T] and ``hidden_states`` [T, k+1, H],
captured by vLLM at the draft's ``eagle_aux_hidden_state_layer_ids`` plus id n (``--include-last-layer``).
Training takes ``hidden_states[:, :-1]`` as the aux states and ``hidden_states[:, -1]`` as the verifier's
last hidden state, which it normalises itself (``verifier_norm``): that entry is ``layer{n-1}.out``,
pre-norm.

SpecForge 0.2.0 (``runtime/data_plane/offline_reader.py``, ``algorithms/eagle3/data.py``,
``offline_capture/``): one ``torch.save`` dict per sample, ``*.ckpt`` or ``*.ckpt.gz``, with
``input_ids`` [T], ``loss_mask`` [T], ``aux_hidden_state`` [1, T, k*H] (SGLang's captures concatenated,
output-of-layer ids) and ``hidden_state`` [1, T, H], SGLang's logits-processor input: ``final``.

Which layers the aux entries are comes from the drafter's wiring (the ids that trained on this data),
else the stack's default ids; the files record none.
"""

from __future__ import annotations

import gzip
import io
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..data.samples import SampleRef
from ..engine_ids import convention
from ..errors import EaglewireError
from ..wiring import CapturePoint, Wiring, WiringError

SPECULATORS, SPECFORGE = "speculators", "specforge"
SOURCES = {SPECULATORS: "speculators 0.9.0", SPECFORGE: "SpecForge 0.2.0"}
_SPECULATORS_DIR = "hidden_states"
_SPECFORGE_SUFFIXES = (".ckpt", ".ckpt.gz")


class ForeignDataError(EaglewireError):
    """A folder that is not, or not wholly, another stack's hidden-state dataset."""


@dataclass(frozen=True)
class StoredEntry:
    """One stored hidden state: where the stack keeps it, what it takes it for, and what for."""

    name: str  # in the stack's own terms, e.g. 'hidden_states[:, 0]'
    claim: CapturePoint  # the tensor of the target the stack takes it for
    role: str  # 'aux[0]' ... or 'teacher' (speculators: the verifier's last state)


def detect_foreign_data(folder: Path) -> str | None:
    """SPECULATORS or SPECFORGE when ``folder`` holds that stack's files, else None."""
    folder = Path(folder)
    if _speculators_files(folder):
        return SPECULATORS
    if _specforge_files(folder):
        return SPECFORGE
    return None


def _speculators_files(folder: Path) -> dict[int, Path]:
    root = folder / _SPECULATORS_DIR if (folder / _SPECULATORS_DIR).is_dir() else folder
    files = {}
    for path in root.glob("hs_*.safetensors"):
        index = path.name[len("hs_"): -len(".safetensors")]
        if index.isdigit():
            files[int(index)] = path
    return dict(sorted(files.items()))


def _specforge_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name.endswith(_SPECFORGE_SUFFIXES))


class ForeignDataset:
    """The samples of a speculators or SpecForge dataset, with what each stored entry is claimed to be.

    ``refs`` carry the token ids (record index: the file's index, or its place in sorted order);
    ``read`` gives one sample's stored entries by name."""

    def __init__(self, folder: Path, stack: str, wiring: Wiring | None, num_layers: int):
        self.folder, self.stack, self.source = Path(folder), stack, SOURCES[stack]
        self.files: dict[int, Path] = (_speculators_files(self.folder) if stack == SPECULATORS else
                                       dict(enumerate(_specforge_files(self.folder))))
        if not self.files:
            raise ForeignDataError(f"{self.folder} holds no {self.source} hidden-state files (hs_<i>.safetensors, or "
                                   "*.ckpt / *.ckpt.gz): give the folder the stack wrote its hidden states to")
        first_index, first_path = next(iter(self.files.items()))
        stored_aux, self.hidden_size = self._shape(self._raw(first_index), first_path)
        self.wiring, self.claims_from = _claimed_wiring(stack, wiring, stored_aux, num_layers)
        self.entries = self._entries(num_layers)
        # the token ids of every sample up front, as the native dataset lists them (no loss mask: unused here)
        self.refs = [SampleRef(index, self._ids(self._raw(index, only_ids=True), path), torch.ones(0, dtype=torch.bool))
                     for index, path in self.files.items()]

    # ---- the two layouts ----------------------------------------------------------------------

    def _raw(self, index: int, only_ids: bool = False) -> dict[str, torch.Tensor]:
        """One sample's stored tensors (``only_ids``: speculators' token ids and nothing else, which is cheap;
        a .ckpt is memory-mapped, so its unread tensors cost nothing either)."""
        path = self.files[index]
        if self.stack == SPECULATORS:
            try:
                with safe_open(str(path), framework="pt") as handle:
                    keys = [k for k in handle.keys() if k == "token_ids" or not only_ids]  # noqa: SIM118 (not a dict)
                    return {key: handle.get_tensor(key) for key in keys}
            except SafetensorError as exc:
                raise ForeignDataError(f"{path} is not a readable safetensors file ({exc}); speculators' "
                                       "generate_offline_data writes it again when it is removed") from exc
        # what torch.load and gzip raise for a truncated file, another format, or a pickle that is not plain tensors
        unreadable = (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError)
        try:
            if path.name.endswith(".gz"):
                with gzip.open(path, "rb") as f:
                    raw = torch.load(io.BytesIO(f.read()), weights_only=True)
            else:
                raw = torch.load(path, weights_only=True, mmap=True)
        except unreadable as exc:
            raise ForeignDataError(f"{path} is not a SpecForge feature file (a torch.save dict of tensors): {exc}") from exc
        if not isinstance(raw, dict):
            raise ForeignDataError(f"{path} holds a {type(raw).__name__}, not SpecForge's dict of tensors")
        return raw

    def _keys(self) -> tuple[str, ...]:
        return ("token_ids", "hidden_states") if self.stack == SPECULATORS else (
            "input_ids", "loss_mask", "hidden_state", "aux_hidden_state")

    def _check_keys(self, raw: dict, path: Path) -> None:
        missing = [k for k in self._keys() if k not in raw]
        if missing:
            raise ForeignDataError(f"{path} lacks {', '.join(missing)}: a {self.source} sample stores "
                                   f"{', '.join(self._keys())}; is this the stack that wrote it?")

    def _shape(self, raw: dict, path: Path) -> tuple[int, int]:
        """(aux entries stored, hidden size), from one sample."""
        self._check_keys(raw, path)
        if self.stack == SPECULATORS:
            states = raw["hidden_states"]
            if states.dim() != 3 or states.shape[1] < 2:
                raise ForeignDataError(f"{path}: hidden_states is {tuple(states.shape)}; speculators stores "
                                       "[tokens, aux layers + 1, hidden size]")
            return states.shape[1] - 1, states.shape[2]
        aux, last = raw["aux_hidden_state"], raw["hidden_state"]
        width = last.shape[-1]
        if aux.shape[-1] % width:
            raise ForeignDataError(f"{path}: aux_hidden_state is {aux.shape[-1]} wide, not a multiple of "
                                   f"hidden_state's {width}")
        return aux.shape[-1] // width, width

    def _ids(self, raw: dict, path: Path) -> torch.Tensor:
        key = "token_ids" if self.stack == SPECULATORS else "input_ids"
        if key not in raw:
            raise ForeignDataError(f"{path} lacks {key}: a {self.source} sample stores {', '.join(self._keys())}")
        return raw[key].reshape(-1).long()

    def _entries(self, num_layers: int) -> tuple[StoredEntry, ...]:
        if self.stack == SPECULATORS:
            aux = [StoredEntry(f"hidden_states[:, {i}]", p, f"aux[{i}]") for i, p in enumerate(self.wiring.aux)]
            last = StoredEntry(f"hidden_states[:, {len(aux)}]", CapturePoint.layer_out(num_layers - 1), "teacher")
            return (*aux, last)
        h = self.hidden_size
        aux = [StoredEntry(f"aux_hidden_state[..., {i * h}:{(i + 1) * h}]", p, f"aux[{i}]")
               for i, p in enumerate(self.wiring.aux)]
        return (*aux, StoredEntry("hidden_state", self.wiring.teacher, "teacher"))

    # ---- reading -----------------------------------------------------------------------------

    def read(self, ref: SampleRef, length: int) -> dict[str, torch.Tensor]:
        """Every stored entry of ``ref``'s sample over its first ``length`` tokens, by entry name."""
        raw, path = self._raw(ref.record_index), self.files[ref.record_index]
        self._check_keys(raw, path)
        if not torch.equal(self._ids(raw, path), ref.input_ids):
            raise ForeignDataError(f"{path} changed while the doctor read it; run it again when nothing writes there")
        if self.stack == SPECULATORS:
            states = raw["hidden_states"][:length]
            parts = [states[:, i] for i in range(states.shape[1])]
        else:
            # stored with a batch dimension of 1 ([1, T, width]), which SpecForge's loader squeezes
            aux, last = (raw[key].reshape(-1, raw[key].shape[-1])[:length] for key in ("aux_hidden_state", "hidden_state"))
            parts = [*aux.split(self.hidden_size, dim=-1), last]
        if len(parts) != len(self.entries):
            raise ForeignDataError(f"{path} stores {len(parts)} hidden states per token, the dataset's first sample "
                                   f"{len(self.entries)}: the files come from different runs")
        lengths = {p.shape[0] for p in parts}
        if lengths != {min(length, ref.length)}:
            raise ForeignDataError(f"{path}: the hidden states cover {sorted(lengths)} tokens, its token ids "
                                   f"{ref.length}; the stack wrote it incompletely")
        return {entry.name: part for entry, part in zip(self.entries, parts)}

    def location(self, ref: SampleRef) -> str:
        return str(self.files[ref.record_index].relative_to(self.folder))


def _claimed_wiring(stack: str, wiring: Wiring | None, stored_aux: int, num_layers: int) -> tuple[Wiring, str]:
    """The aux points the dataset's aux entries are taken for, and who says so."""
    if wiring is not None and len(wiring.aux) == stored_aux:
        return wiring, "the drafter's wiring"
    conv = convention(stack)
    ids = conv.default_ids(num_layers)
    if len(ids) != stored_aux:
        raise ForeignDataError(f"the dataset stores {stored_aux} aux states, the drafter's wiring "
                               f"{'has ' + str(len(wiring.aux)) if wiring is not None else 'is unknown'} and "
                               f"{SOURCES[stack]}'s default ids {ids} are {len(ids)}: check it with the drafter trained on it")
    try:
        return conv.from_ids(ids, num_layers), f"{SOURCES[stack]}'s default ids {ids}"
    except WiringError as exc:
        raise ForeignDataError(f"{SOURCES[stack]}'s default ids {ids} name no wiring of this {num_layers}-layer "
                               f"target ({exc}); check the dataset with the drafter trained on it") from exc
