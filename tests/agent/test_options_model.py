"""The node's options: one model, and every option a flag, a --rdzv-conf key and a variable."""

from __future__ import annotations

import argparse
import re
import warnings
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from elastic import env
from elastic.agent import launch
from elastic.errors import ConfigError
from elastic.node import options
from elastic.rendezvous.options import RendezvousOptions
from elastic.worker import probation, straggler

REPO = Path(__file__).resolve().parents[2]


def _parser() -> argparse.ArgumentParser:
    return launch.build_parser(get_args_parser())


def _help() -> str:
    return re.sub(r"\s+", " ", _parser().format_help())


@pytest.mark.parametrize("option", options.OPTIONS, ids=lambda o: o.key)
def test_every_option_has_a_flag_env_description_and_default_in_help(
    option: options.Option,
) -> None:
    text = _help()
    assert option.description
    assert option.env == env.option(option.key) and option.env.startswith("ELASTIC_")
    entry = re.search(
        re.escape(option.flag) + r"\b.*?\(key " + re.escape(option.key) + r";"
        r" \$(\S+); default: ([^)]+)\)",
        text,
    )
    assert entry is not None, f"{option.flag} is not in --help with its key and default"
    assert entry.group(1) == option.env
    shown = entry.group(2)
    if option.on_off:
        assert shown == ("on" if option.default else "off")
    elif option.default in (None, ""):
        assert shown == "unset"
    else:
        assert shown == str(option.default)


def test_help_lists_our_spellings_with_the_etcd_default() -> None:
    text = _help()
    for flag in ("--etcd", "--run-id", "--node-addr", "--config", "--options-file"):
        assert re.search(re.escape(flag) + r" [A-Z]+ .*?default:", text), flag
    assert "default: localhost:2379" in text


@pytest.mark.parametrize(
    "script_args",
    [
        ["--snapshot", "ckpt.pt", "--epochs", "2"],  # the tutorial's flags, after the script
        ["--snap", "x"],
        ["--standalone", "--nproc-per-node", "3"],  # torchrun's own names, passed through too
    ],
)
def test_a_scripts_flags_after_it_are_never_read_as_ours(script_args: list[str]) -> None:
    parsed = _parser().parse_args(["--nnodes", "1", "script.py", *script_args])
    assert parsed.training_script == "script.py"
    assert parsed.training_script_args == script_args


def test_flags_win_over_rdzv_conf_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_STRAGGLER_RATIO", "3")
    monkeypatch.setenv("ELASTIC_STRAGGLER_STEPS", "4")
    monkeypatch.setenv("ELASTIC_HANG_FLOOR_S", "30")
    argv = [
        "--straggler-steps",
        "7",
        "--rdzv-conf",
        "hang.floor_s=9,straggler.steps=6,last_call_timeout=1",
        "--no-probation-enabled",
        "train.py",
    ]
    args = _parser().parse_args(argv)
    made = options.build(launch.given_options(args))
    assert made.straggler.ratio == 3.0  # env
    assert made.straggler.steps == 7  # flag over --rdzv-conf and env
    assert made.hang.floor_s == 9.0  # --rdzv-conf over env
    assert made.probation.enabled is False
    assert args.rdzv_conf == "last_call_timeout=1"  # the rendezvous keeps its own


def test_the_environment_round_trips_to_the_workers() -> None:
    made = options.build({"straggler.drop": "on", "straggler.ratio": "2.5", "hang.enabled": "1"})
    environ = options.to_env(made)
    assert environ["ELASTIC_STRAGGLER_DROP"] == "1"
    assert straggler.options_from_env(environ) == straggler.Options(2.5, 5, True, 1, 60.0)
    assert straggler.hang_from_env(environ) == (60.0, 10.0)
    assert options.build(options.from_env(environ)) == made


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        (
            "ELASTIC_STRAGGLER",
            "2,3",
            {"straggler.drop": "on", "straggler.ratio": "2", "straggler.steps": "3"},
        ),
        ("ELASTIC_STRAGGLER", "off", {"straggler.drop": "off"}),
        ("ELASTIC_HANG", "2,5", {"hang.enabled": "on", "hang.floor_s": "2", "hang.multiple": "5"}),
        ("ELASTIC_HANG", "on", {"hang.enabled": "on"}),
        (
            "ELASTIC_PROBATION",
            "1,2,4",
            {
                "probation.enabled": "on",
                "probation.first_s": "1",
                "probation.cap_s": "2",
                "probation.max_failures": "4",
            },
        ),
        ("ELASTIC_PROBATION", "off", {"probation.enabled": "off"}),
    ],
)
def test_old_spellings_map_to_the_new_fields_with_a_warning(
    name: str, value: str, expected: dict[str, str]
) -> None:
    options._warned.discard(name)
    with pytest.warns(DeprecationWarning, match=re.escape(name) + ".*deprecated.*use ELASTIC_"):
        found = options.from_env({name: value})
    assert found == expected
    options.build(found)


def test_old_spellings_keep_their_meaning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert straggler.options_from_env({"ELASTIC_STRAGGLER": "2,3"}).drop is True
        assert straggler.hang_from_env({"ELASTIC_HANG": "2,5"}) == (2.0, 5.0)
        got = probation.options_from_env({"ELASTIC_PROBATION": "1,2,4"})
        assert (got.first_s, got.cap_s, got.max_failures) == (1.0, 2.0, 4)
        # the new spelling wins over the old
        both = {"ELASTIC_STRAGGLER": "2,3", "ELASTIC_STRAGGLER_STEPS": "9"}
        assert straggler.options_from_env(both).steps == 9


@pytest.mark.parametrize(
    ("layer", "words"),
    [
        ({"straggler.ratio": "fast"}, ["straggler.ratio", "--straggler-ratio", "'fast'", "number"]),
        ({"straggler.ratio": "0.5"}, ["straggler.ratio", "'0.5'", "greater than 1"]),
        ({"hang.enabled": "maybe"}, ["hang.enabled", "'maybe'", "on or off"]),
        ({"metrics_port": "70000"}, ["metrics_port", "'70000'", "65535"]),
        ({"probation.first_s": "10", "probation.cap_s": "5"}, ["probation.cap_s", "accepted"]),
        ({"snapshot.every": "often"}, ["snapshot.every", "'often'", "accepted"]),
        ({"straggler.speed": "2"}, ["Unknown option 'straggler.speed'", "straggler.ratio"]),
    ],
)
def test_a_bad_value_is_one_sentence_naming_option_value_and_accepted(
    layer: dict[str, str], words: list[str]
) -> None:
    with pytest.raises(ConfigError) as caught:
        options.build(layer)
    message = str(caught.value)
    assert message.endswith(".") and "\n" not in message
    for word in words:
        assert word in message


def test_a_bad_flag_ends_the_agent_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code = launch.main(["--nnodes", "1", "--straggler-ratio", "fast", "train.py"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "--straggler-ratio" in err and "'fast'" in err and len(err.splitlines()) == 1


def test_a_bad_old_spelling_names_the_new_ones() -> None:
    with pytest.raises(ConfigError, match="ELASTIC_STRAGGLER_RATIO"):
        options.from_env({"ELASTIC_STRAGGLER": "2"})


def test_the_rendezvous_refuses_node_options_outside_the_agent() -> None:
    with pytest.raises(ConfigError, match=r"elastic-agent.*\$ELASTIC_STRAGGLER_RATIO"):
        RendezvousOptions.parse({"straggler.ratio": "2"})


def test_no_option_variable_is_read_outside_the_model() -> None:
    """The packed spellings and "off" parses live in one place (elastic.node.options)."""
    for path in (REPO / "elastic").rglob("*.py"):
        text = path.read_text()
        if path.name in ("env.py", "options.py"):
            continue
        assert '"ELASTIC_' not in text, f"{path}: an ELASTIC_* name outside elastic/env.py"
        assert '"off", "false"' not in text and '"0", "off"' not in text, path


def test_every_config_still_validates() -> None:
    from elastic_tools.training.config import load_config

    for path in sorted((REPO / "configs").glob("*.yaml")):
        if path.name == "compose.yaml":
            continue
        load_config(str(path), [])


def test_the_reference_table_lists_every_option() -> None:
    text = (REPO / "docs" / "operations.md").read_text()
    table = text[text.index("## Options") : text.index("## Rendezvous options")]
    for option in options.OPTIONS:
        assert f"| `{option.key}` | `{option.flag}" in table, option.key
        assert f"`{option.env}`" in table, option.env


def test_run_keywords_reach_the_step_times_and_bad_ones_are_a_sentence() -> None:
    import types

    import torch

    import elastic
    from elastic.worker.timing import StepTimes

    given = options.load({}, straggler={"drop": True, "ratio": 4}).straggler
    run = types.SimpleNamespace()
    times = StepTimes(run, run, None, given)  # type: ignore[arg-type]
    assert times.options == straggler.Options(4.0, 5, True, 1, 60.0)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"straggler\.ratio.*0\.5"):
        elastic.Run(model, opt, straggler={"ratio": 0.5})
    with pytest.raises(ConfigError, match=r"Unknown option 'hang\.bound'"):
        elastic.Run(model, opt, hang={"bound": 3})


def test_an_options_file_sits_between_the_environment_and_rdzv_conf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "options.yaml"
    path.write_text("straggler:\n  drop: on\n  ratio: 3\n  steps: 4\nhang.enabled: true\n")
    monkeypatch.setenv("ELASTIC_STRAGGLER_RATIO", "5")
    monkeypatch.setenv("ELASTIC_HANG_FLOOR_S", "7")
    argv = ["--options-file", str(path), "--rdzv-conf", "straggler.steps=6", "train.py"]
    made = options.build(launch.given_options(_parser().parse_args(argv)))
    assert made.straggler.drop is True and made.hang.enabled is True
    assert made.straggler.ratio == 3.0  # the file over the environment
    assert made.straggler.steps == 6  # --rdzv-conf over the file
    assert made.hang.floor_s == 7.0  # the environment where the file says nothing


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("- a\n- b\n", ["holds a list", "accepted: a mapping"]),
        ("straggler: {ratio: [\n", ["not valid YAML", "--options-file"]),
    ],
)
def test_a_bad_options_file_is_one_sentence(tmp_path: Path, text: str, words: list[str]) -> None:
    path = tmp_path / "options.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        options.from_file(str(path))
    for word in words:
        assert word in str(caught.value)
    with pytest.raises(ConfigError, match="Cannot read the options file"):
        options.from_file(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match=r"Unknown option 'straggler\.speed'"):
        options.build(options.from_file(_write(tmp_path, "straggler: {speed: 2}\n")))


def _write(folder: Path, text: str) -> str:
    path = folder / "more.yaml"
    path.write_text(text)
    return str(path)
