"""The shipped worker configs, importable as ``elastic.configs`` once the project is installed.

pyproject.toml maps this directory to the package ``elastic.configs`` and ships its YAML
files as package data, so a wheel install (our Docker image is one) finds them without a
source checkout: ``config_path("default.yaml")``. In a checkout or an editable install the
files are the ones in ``configs/``.
"""

from __future__ import annotations

from pathlib import Path

DIRECTORY = Path(__file__).resolve().parent


def names() -> list[str]:
    """The file names of every shipped config, sorted: ``["compose.yaml", ...]``."""
    return sorted(p.name for p in DIRECTORY.glob("*.yaml"))


def config_path(name: str) -> Path:
    """The path of the shipped config ``name`` (``"default"`` or ``"default.yaml"``).

    Raises :class:`FileNotFoundError` naming the configs that do exist.
    """
    file = name if name.endswith((".yaml", ".yml")) else f"{name}.yaml"
    path = DIRECTORY / file
    if "/" in file or "\\" in file or not path.is_file():
        raise FileNotFoundError(
            f"No shipped config named {name!r} in {DIRECTORY}; "
            f"the shipped ones are {', '.join(names())}."
        )
    return path
