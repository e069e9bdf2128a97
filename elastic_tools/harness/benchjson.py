"""Shared pieces of the ``bench/`` scripts: their JSON result on stdout (and in a file), and
the median and spread of repeated figures.

Every bench script ends the same way: the result as indented JSON on stdout, the same text
in ``--json-out`` when given, exit status 0 (:func:`output`). Repeated figures are summarized
as their count, median, minimum and maximum (:func:`spread`), figures that did not come
(None) left out and counted apart.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def dumps(result: Mapping[str, Any]) -> str:
    """A bench result as the indented JSON every bench script prints."""
    return json.dumps(result, indent=2, default=str)


def output(result: Mapping[str, Any], json_out: Path | None = None) -> int:
    """Print ``result`` as JSON and write the same text to ``json_out`` (when given);
    returns 0, a bench script's exit status once its result is out."""
    text = dumps(result)
    print(text, flush=True)
    if json_out is not None:
        json_out.write_text(text + "\n")
    return 0


def spread(values: Sequence[float | int | None], digits: int = 3) -> dict[str, Any]:
    """``n``, ``median``, ``min`` and ``max`` of the figures that came, and ``missing``: how
    many did not (None). The statistics are None when no figure came."""
    got = [float(v) for v in values if v is not None]
    missing = len(values) - len(got)
    if not got:
        return {"n": 0, "median": None, "min": None, "max": None, "missing": missing}
    return {
        "n": len(got),
        "median": round(statistics.median(got), digits),
        "min": round(min(got), digits),
        "max": round(max(got), digits),
        "missing": missing,
    }


__all__ = ["dumps", "output", "spread"]
