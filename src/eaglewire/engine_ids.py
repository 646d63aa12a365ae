"""Engine layer-id conventions: what an ``eagle_aux_hidden_state_layer_ids`` entry means.

Every stack captures the full residual stream; they differ only in whether id
``j`` names the stream entering decoder layer j (``layer{j-1}.out``, with 0 =
``embed``) or the stream leaving it (``layer{j}.out``). All of them append the
captured states inside the decoder loop, so the fc receives them in stream order
whatever order the ids are listed in. Sources read (2026-11):

- EAGLE reference, SafeAILab/EAGLE @cb7e084 (2026-02-19),
  eagle/model/modeling_llama_kv.py: the stream is appended before layer idx runs,
  idx in (2, n//2, n-3), hard-coded. Input-of-layer convention.
- vLLM 0.33.0 (wheel), vllm/model_executor/models/llama.py forward with
  interfaces.py ``_maybe_add_hidden_state``: the stream is offered once before layer 0
  (slot 0, the embedding alone since the residual is still None) and after every
  layer i (slot i+1, ``hidden_states + residual`` = layer{i}.out); ids from the draft
  config are used verbatim; default get_eagle3_default_aux_hidden_state_layers =
  (2, n//2, n-3). Input-of-layer convention, ids 0..n (n = layer{n-1}.out, pre-norm).
  (vllm @e06c9ba, read before, visited only 1..n-1.)
- speculators 0.9.0 (wheel): ids are vLLM's (data generation runs vLLM);
  models/utils.py resolve_target_layer_ids defaults to [2, n//2, n-3] and accepts
  distinct ids in [0, n].
- SpecForge, sgl-project/SpecForge @a6b6b02 (2026-08-08),
  algorithms/model_providers.py resolve_eagle_capture_layers: default
  [1, n//2-1, n-4]; the old HF backend hooked layers[j] (= layer{j}.out) and the
  SGLang backend relies on SGLang's +1. Output-of-layer convention.
- SGLang, sgl-project/sglang models/llama.py @bf7a0e2: set_eagle3_layers_to_capture
  shifts explicit ids by +1 and captures ``hidden_states + residual`` before that
  layer (= layer{j}.out); ``None`` means [2, n//2, n-3] unshifted. Slot n is never
  reached, so layer{n-1}.out cannot be captured. PR #25454 (opened 2026-05-16)
  makes the +1 conditional on ``ids[0] == 1`` (ids used verbatim otherwise); the
  stored code shows it in deepseek_v2.py, so pick the convention by what your
  SGLang build's model file does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .wiring import CapturePoint, Wiring, WiringError

INPUT_OF_LAYER = "input-of-layer"  # id j = stream entering layer j = layer{j-1}.out, 0 = embed
OUTPUT_OF_LAYER = "output-of-layer"  # id j = layer{j}.out


@dataclass(frozen=True)
class Convention:
    name: str
    meaning: str  # INPUT_OF_LAYER, OUTPUT_OF_LAYER, or "sglang-conditional"
    # Largest id the capture loop reaches, as an offset from n (0: ids up to n, -1: up to n-1).
    max_id_offset: int
    min_id: int
    source: str

    def default_ids(self, num_layers: int) -> list[int]:
        """The ids this stack uses when the config gives none (all name the same tensors)."""
        n = num_layers
        if self.meaning == OUTPUT_OF_LAYER:
            return [1, n // 2 - 1, n - 4]
        return [2, n // 2, n - 3]

    def to_ids(self, wiring: Wiring, num_layers: int) -> list[int]:
        """Ids to write in this stack's config so it captures exactly ``wiring.aux``."""
        wiring.check_reachable(num_layers)
        if list(wiring.aux) != sorted(wiring.aux):
            in_order = ",".join(str(p) for p in sorted(wiring.aux))
            raise WiringError(
                f"{self.name} cannot express {wiring}: every engine appends the captured states in stream "
                f"order (its decoder loop visits layers shallow to deep, whatever the order of the ids), so "
                f"its fc would receive {in_order}; train with the aux points in stream order"
            )
        if self.meaning == "sglang-conditional":
            return _sglang_conditional_ids(wiring, num_layers, self)
        ids = [_point_to_id(p, self.meaning) for p in wiring.aux]
        self._check_range(ids, num_layers, wiring)
        if self.from_ids(ids, num_layers) != wiring:
            raise WiringError(f"{self.name}: ids {ids} do not read back as {wiring}")
        return ids

    def from_ids(self, ids: Sequence[int], num_layers: int) -> Wiring:
        """The canonical tensors this stack captures for ``ids`` on an n-layer target."""
        ids = [int(i) for i in ids]
        if self.meaning == "sglang-conditional":
            # The +1 shift applies only when the first id is 1; otherwise ids are verbatim slots.
            rule = CONVENTIONS["sglang-pre-25454"] if ids and ids[0] == 1 else _SGLANG_VERBATIM
            return rule.from_ids(ids, num_layers)
        self._check_range(ids, num_layers, None)
        # The capture loops append in layer order, not in the order the ids are listed.
        points = tuple(sorted(_id_to_point(i, self.meaning) for i in ids))
        wiring = Wiring(points)
        wiring.check_reachable(num_layers)
        return wiring

    def _check_range(self, ids: list[int], num_layers: int, wiring: Wiring | None) -> None:
        top = num_layers + self.max_id_offset
        bad = [i for i in ids if not self.min_id <= i <= top]
        if bad:
            what = f" for {wiring}" if wiring else ""
            raise WiringError(
                f"{self.name} cannot capture ids {bad}{what}: on a {num_layers}-layer target its capture loop "
                f"only reaches ids {self.min_id}..{top} ({self.source})"
            )


def _point_to_id(point: CapturePoint, meaning: str) -> int:
    if meaning == INPUT_OF_LAYER:
        return point.depth + 1  # embed (-1) -> 0
    if point.is_embed:
        raise WiringError("'embed' has no id in an output-of-layer convention")
    return point.depth


def _id_to_point(layer_id: int, meaning: str) -> CapturePoint:
    if meaning == INPUT_OF_LAYER:
        return CapturePoint(layer_id - 1)  # 0 -> embed
    return CapturePoint.layer_out(layer_id)


def _sglang_conditional_ids(wiring: Wiring, num_layers: int, conv: Convention) -> list[int]:
    # After PR #25454 SGLang adds +1 only when ids[0] == 1. Write output-of-layer ids when
    # they start with 1, else input-of-layer ids; check that the rule reads them back.
    reasons = []
    for meaning in (OUTPUT_OF_LAYER, INPUT_OF_LAYER):
        try:
            ids = [_point_to_id(p, meaning) for p in wiring.aux]
            read_back = conv.from_ids(ids, num_layers)
        except WiringError as err:
            reasons.append(f"as {meaning} ids: {err}")
            continue
        if read_back == wiring:
            return ids
        reasons.append(f"{meaning} ids {ids} are read as {read_back}")
    raise WiringError(
        f"{conv.name} cannot express {wiring} (its rule adds +1 only when the first id is 1): " + "; ".join(reasons)
    )


CONVENTIONS: dict[str, Convention] = {
    c.name: c
    for c in (
        Convention("eagle", INPUT_OF_LAYER, -1, 1, "SafeAILab/EAGLE modeling_llama_kv.py @cb7e084"),
        Convention("vllm", INPUT_OF_LAYER, 0, 0, "vllm 0.33.0 vllm/model_executor/models/llama.py"),
        Convention("speculators", INPUT_OF_LAYER, 0, 0, "speculators 0.9.0 speculators/models/utils.py, vLLM ids"),
        Convention("specforge", OUTPUT_OF_LAYER, -1, 0, "sgl-project/SpecForge model_providers.py @a6b6b02"),
        Convention("sglang-pre-25454", OUTPUT_OF_LAYER, -2, 0, "sgl-project/sglang models/llama.py @bf7a0e2"),
        Convention("sglang-post-25454", "sglang-conditional", -1, 0, "sgl-project/sglang PR #25454 (opened 2026-05-16)"),
    )
}


def convention(name: str) -> Convention:
    if name not in CONVENTIONS:
        raise WiringError(f"unknown engine convention {name!r}; known: {', '.join(CONVENTIONS)}")
    return CONVENTIONS[name]

# SGLang after PR #25454 when ids[0] != 1: slots used as given, captured before that layer runs.
_SGLANG_VERBATIM = Convention("sglang-post-25454", INPUT_OF_LAYER, -1, 1, "sgl-project/sglang PR #25454, verbatim ids")
