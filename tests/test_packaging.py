"""The wheel works without the source tree: packages, shipped configs, console scripts.

Builds the wheel from a copy of the project, installs it with ``--no-deps`` into a fresh
virtualenv, and lends that venv this interpreter's site-packages through a ``.pth`` file
for torch & co. Directories named in a ``.pth`` file are added to ``sys.path`` but their
own ``.pth`` files are not processed, so this environment's editable install (a finder
registered by a ``.pth`` file) cannot shadow the wheel: the test checks that ``elastic``
is imported from the fresh venv. Everything runs with an empty working directory, as a
user of our Docker image (a non-editable install) would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO

# What the wheel is built from (the Dockerfile copies the same).
SOURCES = ("pyproject.toml", "README.md", "elastic", "elastic_tools", "configs")

pytestmark = pytest.mark.timeout(600)


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, (
        f"{' '.join(cmd)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    )
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built from a copy (no build/ left in, or taken from, the clone)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=ignore)
        else:
            shutil.copy2(REPO / name, src / name)
    out = root / "dist"
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    _run([*pip_wheel, "--quiet", "-w", str(out), str(src)], cwd=root)
    (built,) = out.glob("elastic-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with only the wheel installed, borrowing this env's dependencies."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(root)], cwd=root.parent)
    python = root / "bin" / "python"
    pip_install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet"]
    _run([*pip_install, "--no-deps", "--no-index", str(wheel)], cwd=root.parent)
    purelib = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            cwd=root.parent,
        ).strip()
    )
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (purelib / "zz_borrowed_dependencies.pth").write_text("".join(f"{p}\n" for p in ours))
    return root


@pytest.fixture
def clean_env() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("ELASTIC_")
    }


def test_wheel_holds_every_module_and_config(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {
        p.relative_to(REPO).as_posix()
        for package in ("elastic", "elastic_tools")
        for p in (REPO / package).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    missing = sorted(sources - names)
    assert not missing, f"not in the wheel (list the package in pyproject.toml): {missing}"
    configs = {f"elastic/configs/{p.name}" for p in (REPO / "configs").glob("*.yaml")}
    assert configs, "no YAML in configs/"
    assert configs <= names, sorted(configs - names)
    # The runtime and its tooling: nothing that collides with another distribution (``agents``).
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"elastic", "elastic_tools"}, sorted(tops)


@pytest.mark.integration
def test_installed_wheel_imports_and_validates_shipped_configs(
    venv: Path, tmp_path: Path, clean_env: dict[str, str]
) -> None:
    probe = """
import json
import elastic, elastic.agent, elastic.configs
import elastic.rendezvous.registry, elastic_tools.cli
from elastic_tools.training.config import Config, load_config
from elastic.configs import config_path, names
found = {}
for name in names():
    path = config_path(name)
    assert isinstance(load_config(path, []), Config), name
    found[name] = str(path)
assert config_path("default") == config_path("default.yaml")
try:
    config_path("nope")
except FileNotFoundError as exc:
    assert "default.yaml" in str(exc), exc
else:
    raise AssertionError("config_path('nope') did not raise")
print(json.dumps({"elastic": elastic.__file__, "agent": elastic.agent.__file__,
                  "configs": elastic.configs.__file__, "found": found}))
"""
    out = json.loads(_run([str(venv / "bin" / "python"), "-c", probe], tmp_path, clean_env))
    prefix = str(venv.resolve())
    for key in ("elastic", "agent", "configs"):
        assert str(Path(out[key]).resolve()).startswith(prefix), (key, out[key])
    shipped = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
    assert sorted(out["found"]) == shipped
    for path in out["found"].values():
        assert str(Path(path).resolve()).startswith(prefix), path


@pytest.mark.integration
def test_console_scripts_run(venv: Path, tmp_path: Path, clean_env: dict[str, str]) -> None:
    elastic = str(venv / "bin" / "elastic")
    assert "status" in _run([elastic, "--help"], tmp_path, clean_env)
    # The subcommands' own options parse from the wheel (--help runs nothing).
    demo = _run([elastic, "demo", "--help"], tmp_path, clean_env)
    assert "--quick" in demo and "--dashboard-port" in demo, demo
    dashboard = _run([elastic, "dashboard", "--help"], tmp_path, clean_env)
    assert "--event-log" in dashboard and "--port" in dashboard, dashboard
    assert "--rdzv-conf" in _run(
        [str(venv / "bin" / "elastic-agent"), "--help"], tmp_path, clean_env
    )


def _pins() -> dict[str, str]:
    from packaging.utils import canonicalize_name

    lines = (REPO / "constraints.txt").read_text().splitlines()
    pairs = [line.split("==") for line in lines if line and not line.startswith("#")]
    return {canonicalize_name(name): version for name, version in pairs}


def test_constraints_pin_every_dev_requirement_within_its_bounds() -> None:
    """constraints.txt (what `make` installs) agrees with pyproject.toml: regenerate it
    with `make constraints` after changing a dependency."""
    import tomllib
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted, todo, seen = list(project["dependencies"]), ["dev"], set()
    while todo:
        extra = todo.pop()
        seen.add(extra)
        for line in extras[extra]:
            req = Requirement(line)
            if canonicalize_name(req.name) == "elastic":
                todo.extend(e for e in req.extras if e not in seen)
            else:
                wanted.append(line)
    pins = _pins()
    for line in wanted:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not in constraints.txt: run `make constraints`"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {req.name}=={pins[name]} outside {line!r}: "
            "run `make constraints`"
        )
    assert not SpecifierSet(project["requires-python"]).contains("3.10.8")  # CVE-2022-42919
    assert SpecifierSet(project["requires-python"]).contains("3.10.9")


@pytest.mark.unit
def test_the_dockerfile_copies_what_the_wheel_is_built_from() -> None:
    copied: set[str] = set()
    for line in (REPO / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and words[-1].startswith("/app"):
            copied.update(w.rstrip("/") for w in words[1:-1])
    missing = [name for name in SOURCES if name not in copied]
    assert not missing, f"the Dockerfile does not COPY {missing} into /app"
    # docker/build-base.sh sends the build context as a tar of these paths.
    script = (REPO / "docker" / "build-base.sh").read_text()
    listed = script.split("git ls-files", 1)[1].split("|", 1)[0].split()
    missing = [name for name in SOURCES if name not in listed]
    assert not missing, f"docker/build-base.sh leaves {missing} out of the build context"
