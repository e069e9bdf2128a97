"""The rendezvous speaks to etcd only through elastic.etcd.client: no module under
elastic/rendezvous/ imports grpc or the etcd protobufs (read from the sources)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RENDEZVOUS = Path(__file__).resolve().parents[2] / "elastic" / "rendezvous"
FORBIDDEN = ("grpc", "etcd3")


def imported(path: Path) -> set[str]:
    """The top-level packages a module imports, and ``etcdrpc`` if it names it at all."""
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
        elif isinstance(node, (ast.Name, ast.Attribute)) and "etcdrpc" in (
            getattr(node, "id", None),
            getattr(node, "attr", None),
        ):
            names.add("etcd3")
    return names


MODULES = sorted(RENDEZVOUS.rglob("*.py"))


def test_the_announce_package_is_covered() -> None:
    names = {p.relative_to(RENDEZVOUS).as_posix() for p in MODULES}
    assert {"announce/handler.py", "announce/closer.py", "announce/keeper.py"} <= names


@pytest.mark.parametrize(
    "path", MODULES, ids=[p.relative_to(RENDEZVOUS).as_posix() for p in MODULES]
)
def test_no_rendezvous_module_imports_grpc_or_etcd_protobufs(path: Path) -> None:
    assert not imported(path) & set(FORBIDDEN), f"{path} imports {imported(path) & set(FORBIDDEN)}"
