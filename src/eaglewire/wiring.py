"""The canonical, engine-neutral names of the target's residual-stream tensors.

A capture point is one of:
  ``embed``        output of the token embedding = input of decoder layer 0
  ``layer{i}.out`` residual stream after decoder layer i (0-based)
  ``final``        output of the final norm (what the target's lm_head reads)

A ``Wiring`` is the ordered list of aux capture points the drafter's ``fc``
concatenates, plus the point the training teacher reads. It is stored in the
data manifest and the drafter checkpoint; no other code decides which tensors
to capture.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import EaglewireError

EMBED = "embed"
FINAL = "final"
_LAYER_RE = re.compile(r"^layer(0|[1-9][0-9]*)\.out$")


class WiringError(EaglewireError):
    """A capture point or wiring that is malformed or not reachable in a target."""


@dataclass(frozen=True, order=True)
class CapturePoint:
    """One tensor of the residual stream, ordered by depth: embed < layer0.out < ... < final."""

    depth: int  # -1 = embed, i = layer{i}.out, FINAL_DEPTH = final
    FINAL_DEPTH = 1 << 30

    @classmethod
    def parse(cls, text: str) -> "CapturePoint":
        name = text.strip()
        if name == EMBED:
            return cls(-1)
        if name == FINAL:
            return cls(cls.FINAL_DEPTH)
        match = _LAYER_RE.match(name)
        if match is None:
            raise WiringError(
                f"unknown capture point {text!r}: expected 'embed', 'layer<i>.out' "
                "(0-based decoder layer index, e.g. 'layer14.out') or 'final'"
            )
        return cls(int(match.group(1)))

    @classmethod
    def layer_out(cls, index: int) -> "CapturePoint":
        if index < 0:
            raise WiringError(f"layer index must be >= 0, got {index}")
        return cls(index)

    @property
    def is_embed(self) -> bool:
        return self.depth == -1

    @property
    def is_final(self) -> bool:
        return self.depth == self.FINAL_DEPTH

    @property
    def layer(self) -> int:
        """0-based decoder layer whose output this is; only for ``layer{i}.out``."""
        if self.is_embed or self.is_final:
            raise WiringError(f"{self} is not a decoder-layer output")
        return self.depth

    def check_reachable(self, num_layers: int) -> None:
        """Raise unless this point exists in a target with ``num_layers`` decoder layers."""
        if not (self.is_embed or self.is_final) and self.depth >= num_layers:
            raise WiringError(
                f"capture point {self} does not exist: the target has {num_layers} decoder "
                f"layers, so layer outputs run from layer0.out to layer{num_layers - 1}.out"
            )

    def __str__(self) -> str:
        if self.is_embed:
            return EMBED
        if self.is_final:
            return FINAL
        return f"layer{self.depth}.out"


def all_points(num_layers: int) -> list[CapturePoint]:
    """Every capture point of a target, in stream order (the doctor's candidates)."""
    return [CapturePoint(-1), *(CapturePoint(i) for i in range(num_layers)), CapturePoint(CapturePoint.FINAL_DEPTH)]


@dataclass(frozen=True)
class Wiring:
    """Which tensors feed the drafter's fc (in order) and which the teacher reads."""

    aux: tuple[CapturePoint, ...]
    teacher: CapturePoint = CapturePoint(CapturePoint.FINAL_DEPTH)

    def __post_init__(self) -> None:
        if not self.aux:
            raise WiringError("a wiring needs at least one aux capture point")
        if len(set(self.aux)) != len(self.aux):
            raise WiringError(f"aux capture points repeat: {self}")
        if any(p.is_final for p in self.aux):
            raise WiringError(
                "'final' cannot be an aux capture point: it is the teacher's input, and no engine captures it "
                "for the drafter's fc"
            )
        if not self.teacher.is_final:
            raise WiringError(f"the teacher must read 'final' (the lm_head input), got {self.teacher}")

    @classmethod
    def parse(cls, text: str) -> "Wiring":
        """Parse ``"layer1.out,layer14.out,layer26.out"``."""
        parts = [p.strip() for p in text.split(",")]
        if not any(parts):
            raise WiringError("empty wiring: give comma-separated capture points, e.g. layer1.out,layer14.out,layer26.out")
        if "" in parts:
            # Dropping the empty entry would silently change how many tensors the fc concatenates.
            raise WiringError(
                f"empty capture point in wiring {text!r} (stray comma?): give comma-separated capture points, "
                "e.g. layer1.out,layer14.out,layer26.out"
            )
        return cls(tuple(CapturePoint.parse(p) for p in parts))

    @classmethod
    def default(cls, num_layers: int) -> "Wiring":
        """The common EAGLE-3 default: layer1.out, layer{n//2-1}.out, layer{n-4}.out."""
        if num_layers < 7:  # below 7 the three points are not distinct (n=6: layer1, layer2, layer2)
            raise WiringError(
                f"the default EAGLE-3 wiring (layer1.out, layer{{n//2-1}}.out, layer{{n-4}}.out) needs at least "
                f"7 decoder layers to name 3 distinct points, the target has {num_layers}; pass --wiring explicitly"
            )
        return cls(tuple(CapturePoint.layer_out(i) for i in (1, num_layers // 2 - 1, num_layers - 4)))

    @classmethod
    def resolve(cls, text: str | None, num_layers: int) -> "Wiring":
        """``--wiring`` as given, or the default for the target; checked against its depth."""
        wiring = cls.parse(text) if text else cls.default(num_layers)
        wiring.check_reachable(num_layers)
        return wiring

    def check_reachable(self, num_layers: int) -> None:
        for point in (*self.aux, self.teacher):
            point.check_reachable(num_layers)

    @property
    def points(self) -> tuple[CapturePoint, ...]:
        """Every tensor a capture must return: the aux points, then the teacher's."""
        return (*self.aux, self.teacher)

    def to_json(self) -> dict:
        return {"aux": [str(p) for p in self.aux], "teacher": str(self.teacher)}

    @classmethod
    def from_json(cls, data: dict) -> "Wiring":
        if set(data) != {"aux", "teacher"}:
            raise WiringError(f"wiring record must have exactly the keys 'aux' and 'teacher', got {sorted(data)}")
        return cls(tuple(CapturePoint.parse(p) for p in data["aux"]), CapturePoint.parse(data["teacher"]))

    def __str__(self) -> str:
        return ",".join(str(p) for p in self.aux)
