"""Nothing under elastic/ unpickles what a peer, etcd or storage sends, outside an allowlist.

An AST scan of every module under ``elastic/``: it fails on any ``torch.distributed``
``*_object`` / ``*_object_list`` collective (they pickle and unpickle), ``pickle.load``,
``pickle.loads`` or ``pickle.Unpickler`` (also of ``_pickle``, ``cloudpickle`` and ``dill``),
``marshal.load(s)``, ``torch.load`` without ``weights_only=True``, and torch's DCP drivers
(``dcp.save`` / ``dcp.load`` and their older and private names) without ``no_dist=True``:
with ranks, they move plans, results and errors between them as pickles (use
``elastic.checkpoint.dcp_driver`` instead). However they are imported or aliased, each is a
finding except at the sites of :data:`ALLOWED`, each with the reason its bytes may be
unpickled. An allowlist entry that no longer matches fails too (it would hide a new site in
the same function). The scanner itself is tested on planted source.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO, run_ranks

PACKAGE = REPO / "elastic"

OBJECT_COLLECTIVES = frozenset(
    {
        "all_gather_object",
        "broadcast_object_list",
        "gather_object",
        "scatter_object_list",
        "send_object_list",
        "recv_object_list",
        "broadcast_object",
        "scatter_object",
        "_object_to_tensor",
        "_tensor_to_object",
    }
)
PICKLE_MODULES = frozenset({"pickle", "_pickle", "cPickle", "cloudpickle", "dill"})
# and the pure-Python unpickler (pickle._Unpickler, _load, _loads)
PICKLE_READERS = frozenset({"load", "loads", "Unpickler", "_load", "_loads", "_Unpickler"})
MARSHAL_READERS = frozenset({"load", "loads"})
TORCH_LOADS = frozenset({"torch.load", "torch.serialization.load"})
# torch's DCP drivers: between ranks (unless no_dist=True) they pickle (utils._DistWrapper).
DCP_MODULES = (
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict_saver",
    "torch.distributed.checkpoint.state_dict_loader",
)
DCP_DRIVERS = {
    f"{module}.{name}": f"dcp.{kind}"
    for module in DCP_MODULES
    for kind, names in {
        "save": ("save", "async_save", "save_state_dict", "_save_state_dict"),
        "load": ("load", "load_state_dict", "_load_state_dict", "_load_state_dict_from_keys"),
    }.items()
    for name in names
}

# (module path under the repo, enclosing function's qualified name, what) -> why it is safe.
ALLOWED: dict[tuple[str, str, str], str] = {
    (
        "elastic/checkpoint/dcp_metadata.py",
        "_MetadataUnpickler",
        "pickle._Unpickler",
    ): "DCP's .metadata, read only after metadata_problem() matched its size, CRC-32 and "
    "SHA-256 against the commit marker that this rank read and verified itself (HMAC-signed "
    "with the job secret, vouched for by the etcd commit record), and then through "
    "find_class restricted to DCP's metadata classes, torch.Size, dtypes and layouts "
    "(dcp_metadata.ALLOWED), by Python's pure unpickler whose BUILD, APPEND(S), SETITEM(S) "
    "and ADDITEMS act only on the fresh dataclasses, lists, dicts and sets it built: a member "
    "that holds the secret still runs no code and changes no class (test_metadata_poison.py)",
    (
        "elastic_tools/status.py",
        "_StateUnpickler",
        "pickle.Unpickler",
    ): "`elastic status` unpickles torch's single-key rendezvous state only after its HMAC "
    "with the job secret verified (decode_state), and through find_class restricted to "
    "torch's rendezvous state classes",
    (
        "elastic_tools/training/data.py",
        "_CifarUnpickler",
        "pickle.Unpickler",
    ): "the CIFAR-10 python batches at the dataset URL the operator configured (our demo "
    "worker only, never peer or etcd input), through find_class restricted to numpy array "
    "constructors",
}

# DCP calls tolerated until a pending change moves them onto elastic.checkpoint.dcp_driver
# (an error once they are gone); none now.
PENDING: frozenset[tuple[str, str, str]] = frozenset()


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    scope: str
    what: str

    @property
    def site(self) -> tuple[str, str, str]:
        return self.path, self.scope, self.what


class _Scanner(ast.NodeVisitor):
    """Finds the unpickling calls and references of one module, through its imports."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.modules: dict[str, str] = {}  # local name -> module it is (import x as y)
        self.names: dict[str, str] = {}  # local name -> "module.attr" (from x import attr)
        self.scope: list[str] = []
        self.found: list[Finding] = []
        self._called: set[int] = set()  # DCP drivers seen as the function of a call

    def _add(self, node: ast.AST, what: str) -> None:
        line = getattr(node, "lineno", 0)
        self.found.append(Finding(self.path, line, ".".join(self.scope), what))

    def _scoped(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self.modules[alias.asname] = alias.name
            else:
                top = alias.name.split(".")[0]
                self.modules[top] = top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        for alias in node.names:
            local = alias.asname or alias.name
            full = f"{module}.{alias.name}" if module else alias.name
            self.names[local] = full
            self.modules[local] = full  # a submodule imported by name (from torch import x)
            what = self._classify(full)
            if what:
                self._add(node, what)

    def _dotted(self, node: ast.expr) -> str | None:
        """The fully qualified name of ``a.b.c`` through this module's imports."""
        if isinstance(node, ast.Name):
            return self.names.get(node.id) or self.modules.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._dotted(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    @staticmethod
    def _classify(full: str) -> str | None:
        module, _, attr = full.rpartition(".")
        if attr in OBJECT_COLLECTIVES and module.startswith("torch.distributed"):
            return f"dist.{attr}"
        if attr in PICKLE_READERS and module in PICKLE_MODULES:
            return f"pickle.{attr}"
        if attr in MARSHAL_READERS and module == "marshal":
            return f"marshal.{attr}"
        return None

    def _driver(self, node: ast.expr, full: str | None) -> None:
        """A DCP driver named other than as the function of a call (a partial, an alias
        handed on): it may be called with ranks, so it is a finding too."""
        if full in DCP_DRIVERS and id(node) not in self._called:
            self._add(node, DCP_DRIVERS[full])

    def visit_Name(self, node: ast.Name) -> None:
        self._driver(node, self.names.get(node.id))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        full = self._dotted(node)
        self._driver(node, full)
        what = self._classify(full) if full else None
        if what:
            self._add(node, what)
        elif node.attr in OBJECT_COLLECTIVES or node.attr.endswith("_object_list"):
            self._add(node, f"dist.{node.attr}")  # on any object: a group wrapper, c10d...
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        full = self._dotted(node.func)
        if full in TORCH_LOADS and not _keyword_true(node, "weights_only"):
            self._add(node, "torch.load")
        if full in DCP_DRIVERS:
            self._called.add(id(node.func))
            if not _keyword_true(node, "no_dist"):
                self._add(node, DCP_DRIVERS[full])
        self.generic_visit(node)


def _keyword_true(call: ast.Call, name: str) -> bool:
    return any(
        k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is True
        for k in call.keywords
    )


def scan(source: str, path: str = "<planted>") -> list[Finding]:
    """Every unpickling site of ``source``."""
    scanner = _Scanner(path)
    scanner.visit(ast.parse(source, filename=path))
    return scanner.found


def scan_package() -> list[Finding]:
    found: list[Finding] = []
    for file in sorted([*PACKAGE.rglob("*.py"), *(REPO / "elastic_tools").rglob("*.py")]):
        found += scan(file.read_text(), str(file.relative_to(REPO)))
    return found


@pytest.mark.integration
def test_nothing_under_elastic_unpickles_outside_the_allowlist() -> None:
    found = scan_package()
    assert len(found) > 0  # the allowlisted sites are seen: the scanner reads the package
    rogue = [f for f in found if f.site not in set(ALLOWED) | PENDING]
    assert not rogue, "unpickling outside the allowlist:\n" + "\n".join(
        f"  {f.path}:{f.line} ({f.scope or 'module'}): {f.what}" for f in rogue
    )
    stale = set(ALLOWED) - {f.site for f in found}
    assert not stale, f"allowlist entries that match nothing any more: {sorted(stale)}"
    done = PENDING - {f.site for f in found}
    assert not done, f"fixed, so drop them from PENDING: {sorted(done)}"


def test_every_allowlist_entry_gives_its_reason() -> None:
    assert all(len(reason.split()) >= 8 for reason in ALLOWED.values())


PLANTED = [
    (
        "import torch.distributed as dist\ndist.all_gather_object(out, x)\n",
        "dist.all_gather_object",
    ),
    (
        "from torch.distributed import broadcast_object_list as b\nb([x], src=0)\n",
        "dist.broadcast_object_list",
    ),
    ("import torch\ntorch.distributed.gather_object(x)\n", "dist.gather_object"),
    ("def f(group):\n    group.scatter_object_list(a, b)\n", "dist.scatter_object_list"),
    (
        "from torch.distributed import distributed_c10d as c\nc._tensor_to_object(t, n, g)\n",
        "dist._tensor_to_object",
    ),
    (
        "import pickle\nclass A:\n    def f(self, b):\n        return pickle.loads(b)\n",
        "pickle.loads",
    ),
    ("import pickle as p\np.load(open('x', 'rb'))\n", "pickle.load"),
    ("from pickle import loads\nloads(b)\n", "pickle.loads"),
    ("import _pickle\nclass U(_pickle.Unpickler):\n    pass\n", "pickle.Unpickler"),
    ("import pickle\nclass U(pickle._Unpickler):\n    pass\n", "pickle._Unpickler"),
    ("import marshal\nmarshal.loads(b)\n", "marshal.loads"),
    ("import torch\ntorch.load(f)\n", "torch.load"),
    ("import torch\ntorch.load(f, weights_only=False)\n", "torch.load"),
    ("from torch import load\nload(f, map_location='cpu')\n", "torch.load"),
    ("import torch as t\nt.serialization.load(f)\n", "torch.load"),
    (
        "import torch.distributed.checkpoint as dcp\ndcp.save(s, storage_writer=w)\n",
        "dcp.save",
    ),
    ("import torch\ntorch.distributed.checkpoint.load(s, checkpoint_id=p)\n", "dcp.load"),
    ("from torch.distributed.checkpoint import load as l\nl(s, no_dist=False)\n", "dcp.load"),
    ("from torch.distributed import checkpoint as c\nc.async_save(s)\n", "dcp.save"),
    (
        "from torch.distributed.checkpoint.state_dict_loader import _load_state_dict\n"
        "_load_state_dict(s, r)\n",
        "dcp.load",
    ),
    (
        "from torch.distributed.checkpoint.state_dict_saver import save_state_dict as s\n"
        "class M:\n    def f(self):\n        s(x, w, no_dist=flag)\n",
        "dcp.save",
    ),
    (
        "import functools\nimport torch.distributed.checkpoint as dcp\n"
        "save = functools.partial(dcp.save, no_dist=True)\n",
        "dcp.save",
    ),
    ("from torch.distributed.checkpoint import save\nhook = save\n", "dcp.save"),
]


@pytest.mark.parametrize(("source", "what"), PLANTED, ids=[w for _, w in PLANTED])
def test_the_scanner_catches_a_planted_call(source: str, what: str) -> None:
    assert what in {f.what for f in scan(source)}


def test_the_scanner_lets_safe_code_pass() -> None:
    safe = (
        "import pickle\nimport torch\nimport torch.distributed as dist\n"
        "torch.load(f, weights_only=True)\ndist.all_gather(out, t)\n"
        "dist.broadcast(t, src=0)\nexcept_ = pickle.UnpicklingError\n"
        "def lookup_object(self, index): return index\n"
        "import torch.distributed.checkpoint as dcp\n"
        "from torch.distributed.checkpoint.state_dict_loader import _load_state_dict\n"
        "dcp.load(s, storage_reader=r, no_dist=True)\n_load_state_dict(s, r, no_dist=True)\n"
        "dcp.FileSystemReader(p)\nfrom elastic.checkpoint import dcp_driver\n"
        "dcp_driver.save(s, storage_writer=w, process_group=g)\n"
    )
    assert scan(safe) == []


@pytest.mark.integration
def test_a_planted_call_in_a_module_fails_the_package_check(tmp_path: Path) -> None:
    """The check itself, on a copy of one allowlisted module with a second site in it."""
    source = (PACKAGE / "checkpoint" / "dcp_metadata.py").read_text()
    planted = source + "\n\ndef _sneaky(b: bytes) -> object:\n    return pickle.loads(b)\n"
    found = scan(planted, "elastic/checkpoint/dcp_metadata.py")
    rogue = [f for f in found if f.site not in ALLOWED]
    assert [(f.scope, f.what) for f in rogue] == [("_sneaky", "pickle.loads")]


# -- what replaced the checkpoint manager's pickling collectives -----------------------------

WORKER = r"""
import json, os, sys
import torch.distributed as dist
from elastic.checkpoint import manager, wire
from elastic.errors import CheckpointError

rank, path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
mine = wire.Verdict.ok({f"__{rank}_0.distcp": {"size": 3, "crc32": "0a"}}).to_json()
step = {"step": 4, "digest": "0" * 64}
out = {
    "gather": [v.detail for v in wire.all_gather_json(mine, manager._result)],
    "broadcast": wire.broadcast_json(step if rank == 0 else None, manager._choice),
}
hostile = {"step": 4, "url": "data:application/octet-stream;base64,gAQu", "step_dir": "x",
           "metadata": None}  # a place to read, not a step and its marker's digest
try:
    wire.broadcast_json(hostile if rank == 0 else None, manager._choice)
    out["url"] = "accepted"
except CheckpointError as exc:
    out["url"] = str(exc)
encode = wire._encode
planted = {
    "pickle": b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00K\x01.",  # pickle.dumps(1)
    "shape": json.dumps({"ok": "yes", "error": 1, "files": []}).encode(),
    "oversized": b" " * 2048,
}
wire.MAX_WIRE = 1024
for name, data in planted.items():
    if rank == 1:
        wire._encode = lambda value, data=data: data
    try:
        wire.all_gather_json(mine, manager._result)
        out[name] = "accepted"
    except CheckpointError as exc:
        out[name] = str(exc)
    wire._encode = encode
dist.barrier()
print(json.dumps(out), flush=True)
os._exit(0)  # not gloo's teardown: it aborts a rank whose peer left first
"""


@pytest.mark.slow
def test_the_checkpoint_messages_are_checked_json_on_every_rank(tmp_path: Path) -> None:
    """Two real gloo ranks: what they exchange round-trips, and a pickle, a wrong shape or
    an oversized length sent by one rank is refused on both, in one sentence each."""
    results = run_ranks(WORKER, str(tmp_path / "store"), timeout=120)
    for rank, got in enumerate(results):
        assert got["gather"] == [{f"__{r}_0.distcp": {"size": 3, "crc32": "0a"}} for r in (0, 1)]
        assert got["broadcast"]["step"] == 4, rank
        assert "Rank 1 sent a checkpoint message that is no JSON" in got["pickle"]
        assert "from rank 1 is not a step outcome" in got["shape"]
        assert "Rank 1 announced a checkpoint message of 2048 bytes" in got["oversized"]
        assert "from rank 0 is not a checkpoint step and its marker's digest" in got["url"]
