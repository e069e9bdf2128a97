"""One injected fault and how the job came back: the record the injectors fill in, the
recovery observer completes and the report counts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class Fault:
    """One injected fault and how the job came back."""

    kind: str
    t: float
    step_before: int
    node: str = ""
    t_end: float = 0.0
    hit: bool = True  # False: an aimed fault whose moment was not observed ("attempted")
    detail: str = ""
    world: int = 0  # the world size expected after it
    recover_s: float | None = None
    resumed_at: int | None = None
    steps_lost: int | None = None
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in ("", None)}


__all__ = ["Fault"]
