"""The house's shape, as counts read from the source (tests/house/structure.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.house import structure


def test_the_runtime_packages_import_each_other_one_way() -> None:
    assert structure.package_circles(structure.import_graph()) == []


def test_the_worker_modules_import_each_other_one_way() -> None:
    """Run's parts take what they share (elastic.worker.parts), never the Run: no circle."""
    graph = structure.import_graph()
    worker = [c for c in structure.circles(graph) if any(m.startswith("elastic.worker") for m in c)]
    assert worker == []


def test_no_worker_module_reaches_into_another_objects_private_state() -> None:
    """Besides groups.py, the one door to c10d's internals (DDP's private methods)."""
    reaches = structure.private_reaches(structure.RUNTIME / "worker")
    assert [r for r in reaches if not r.startswith("elastic/worker/groups.py:")] == []


def test_the_runtime_top_level_holds_at_most_six_modules() -> None:
    loose = structure.loose_modules()
    assert len(loose) <= 6, loose


def test_the_analysis_sees_a_circle_and_a_reach() -> None:
    """The counters can fail: a planted circle and a planted reach are found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert structure.circles(graph) == [["a", "b", "c"]]
    root = structure.REPO / "tests" / "house"
    reaches = structure.private_reaches(root)
    assert any("run._planted" in r for r in reaches), reaches


def _planted(run: object) -> object:  # read by the test above, never called
    return run._planted  # type: ignore[attr-defined]


@pytest.mark.integration
def test_importing_the_runtime_loads_no_tooling() -> None:
    code = (
        "import sys, elastic; elastic.Run; elastic.init_process_group\n"
        "import elastic.agent.launch, elastic.agent.node, elastic.rendezvous.registry\n"
        "import elastic.checkpoint.manager, elastic.worker.session\n"
        "print([m for m in sys.modules if m.startswith('elastic_tools')])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
