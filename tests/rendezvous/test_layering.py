"""Layering read from the sources: the rendezvous speaks to etcd only through
elastic.etcd.client (no module under elastic/rendezvous/ imports grpc or the etcd
protobufs), and private torch names stay behind their two doors: ``checkpoint/storage.py``
for DCP and ``worker/groups.py`` for c10d and DDP. A private name is a module or attribute
whose name starts with one underscore (not a dunder), imported from torch or reached
through a torch module, however it is imported or aliased."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "elastic"
RENDEZVOUS = PACKAGE / "rendezvous"
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


# -- private torch names: only through the declared doors --------------------------------------

DOORS = {"checkpoint/storage.py", "worker/groups.py"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.AST) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _ddp_privates() -> frozenset[str]:
    """DDP's own private members (not nn.Module's): reached on a user's model object, so
    by their name wherever they are used."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    inherited = set(dir(nn.Module)) | {"_abc_impl"}
    return frozenset(n for n in dir(DistributedDataParallel) if _private(n) and n not in inherited)


DDP_PRIVATES = _ddp_privates()


def torch_privates(source: str) -> list[str]:
    """The private torch names ``source`` imports or reaches (``line: name``), and DDP's
    private members by name on any object."""
    tree = ast.parse(source)
    torch_names: set[str] = set()  # local names bound to torch modules or objects
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] != "torch":
                    continue
                if any(_private(p) for p in parts):
                    found.append(f"{node.lineno}: import {alias.name}")
                torch_names.add(alias.asname or parts[0])
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            parts = node.module.split(".")
            if parts[0] != "torch":
                continue
            for alias in node.names:
                if any(_private(p) for p in parts) or _private(alias.name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                else:
                    torch_names.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store | ast.Del):
            dotted = _dotted(node)
            if dotted and dotted[0] in torch_names and _private(dotted[-1]):
                found.append(f"{node.lineno}: {'.'.join(dotted)}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            dotted = _dotted(node)
            if dotted and dotted[0] in torch_names:
                found.append(f"{node.lineno}: {'.'.join(dotted)} (written)")
        if isinstance(node, ast.Attribute) and node.attr in DDP_PRIVATES:
            found.append(f"{node.lineno}: .{node.attr} (DDP's)")
    return found


PACKAGE_MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize(
    "path", PACKAGE_MODULES, ids=[p.relative_to(PACKAGE).as_posix() for p in PACKAGE_MODULES]
)
def test_private_torch_names_only_through_their_doors(path: Path) -> None:
    if path.relative_to(PACKAGE).as_posix() in DOORS:
        return
    found = torch_privates(path.read_text())
    assert not found, (
        f"{path.relative_to(PACKAGE)} uses private torch names: {found}; reach them through "
        "checkpoint/storage.py (DCP) or worker/groups.py (c10d, DDP)"
    )


def test_the_doors_are_where_the_privates_are() -> None:
    for door in DOORS:
        assert torch_privates((PACKAGE / door).read_text()), door


@pytest.mark.parametrize(
    "source",
    [
        "from torch.distributed.checkpoint.filesystem import _StorageInfo\n",
        "import torch.distributed.checkpoint._fsspec_filesystem as f\n",
        "import torch\nx = torch._dynamo\n",
        "import torch.distributed as dist\ndist._register_comm_hook(m, s, h)\n",
        "from torch import nn\nisinstance(m, nn.modules.batchnorm._BatchNorm)\n",
        "import torch.distributed.distributed_c10d as c10d\nc10d._world.pg_map = {}\n",
        "model._distributed_broadcast_coalesced = broadcast\n",
    ],
)
def test_the_scanner_catches_a_planted_private(source: str) -> None:
    assert torch_privates(source)


def test_the_scanner_lets_public_names_and_dunders_pass() -> None:
    source = (
        "import torch\nimport torch.distributed as dist\nfrom torch import nn\n"
        "x = torch.__version__\ndist.all_reduce(t)\nself._private = 1\n"
        "from torch.distributed.checkpoint import FileSystemReader\n"
    )
    assert torch_privates(source) == []


@pytest.mark.unit
def test_the_runtime_never_imports_the_tooling() -> None:
    """``elastic`` (what a job imports) names nothing of ``elastic_tools`` (the chaos runner,
    the harness, the CNN worker, the demo, the dashboard): only as a string, for a command."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [
                f"{path.relative_to(PACKAGE)}:{node.lineno} imports {name}"
                for name in names
                if name.split(".")[0] == "elastic_tools"
            ]
    assert not offenders, offenders
