"""elastic-agent and elastic status from the outside: bad input, a user's own script, status."""

from __future__ import annotations

import dataclasses
import json
import secrets
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest

from elastic import env
from elastic.etcd.server import EtcdServer
from elastic_tools.harness.cluster import fast_conf
from tests.agent.jobs import Job
from tests.helpers import (
    FAST_CONF,
    PYTHON,
    REPO,
    agent_argv,
    local_cluster,
    node_env,
    run_node,
    run_process,
    wait_until,
)


def run(*argv: str, timeout: float = 120, **extra_env: str) -> subprocess.CompletedProcess[str]:
    return run_process([PYTHON, *argv], timeout, **extra_env)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("worker_args", "needle"),
    [
        (["--config", "/no/such.yaml"], "Cannot read config file /no/such.yaml"),
        (["--config", "configs/tiny.yaml", "model.name=nonet"], "model.name = 'nonet'"),
        ([], "needs --config FILE"),
    ],
)
def test_bad_worker_config_is_one_line_before_any_rendezvous(
    worker_args: list[str], needle: str
) -> None:
    worker = ["-m", "elastic_tools.training.worker", *worker_args]
    result = run_process(agent_argv(worker, nnodes="1", rdzv_conf=""))
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("elastic-agent")]
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert "Traceback" not in result.stderr


USER_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(3, 1))
    model(torch.ones(4, 3)).sum().backward()
    grad = model.module.weight.grad.clone()
    dist.all_reduce(grad)
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}"), "w") as f:
        f.write(f"{dist.get_world_size()} {grad.sum().item():.4f}")
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_a_users_own_ddp_script_runs_unchanged(
    tmp_path: Path, etcd: EtcdServer, run_id: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT)
    options = {"nnodes": "1", "nproc": 2, "rdzv_conf": FAST_CONF}
    with local_cluster(tmp_path / "run", etcd.endpoint, run_id, **options) as cluster:
        code, output = run_node(cluster, [str(script), str(tmp_path)], 120)
    assert code == 0, output[-3000:]
    outputs = {(tmp_path / f"rank{r}").read_text() for r in range(2)}
    assert len(outputs) == 1 and next(iter(outputs)).startswith("2 ")


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["single-key", "announce"])
def test_status_reports_members_round_and_checkpoint(job: Job, algorithm: str) -> None:
    conf = f"{fast_conf(job.options.join_timeout)},algorithm={algorithm}"
    job.options = dataclasses.replace(job.options, rdzv_conf=conf)
    # The job's secret: the agents sign the rendezvous state with it, and status decodes
    # the (pickled) single-key state only with it.
    secret = job.tmp / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    with_secret = {env.SECRET_FILE: str(secret)}
    assert job.env is not None
    job.env.update(with_secret)
    nodes = [job.start(n) for n in "ab"]
    wait_until(lambda: any(e["step"] >= 6 for e in job.steps()), 120, "step 6")
    result = run(
        "-m",
        "elastic_tools.cli",
        "status",
        "--etcd",
        job.endpoint,
        "--run-id",
        job.run_id,
        "--checkpoint-url",
        str(job.tmp / "ckpt"),
        "--json",
        **with_secret,
    )
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    rdzv = status["rendezvous"]
    assert rdzv["complete"] and rdzv["world_size"] == 2
    assert sorted(m["state"] for m in rdzv["members"]) == ["rank 0", "rank 1"]
    assert all(m["last_heartbeat_s_ago"] < 10 for m in rdzv["members"])
    newest = status["checkpoint"]["newest_complete_step"]
    assert newest >= 5
    from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints
    from elastic.rendezvous.keys import RunKeys

    with EtcdClient(EtcdOptions(parse_endpoints(job.endpoint)[0])) as client:
        commits = client.range(RunKeys("/elastic", job.run_id).root + b"commits/", prefix=True)
    committed = {kv.key.decode().rsplit("-", 1)[1] for kv in commits.kvs}
    if algorithm == "announce":
        assert str(newest) in committed, "every commit passes the round fence in etcd"
    else:  # torch's own handler publishes no round fence: checkpoints are not fenced
        assert committed == set()
    status_argv = ["-m", "elastic_tools.cli", "status", "--etcd", job.endpoint]
    table = run(*status_argv, "--run-id", job.run_id, **with_secret)
    assert f"run {job.run_id}" in table.stdout and "world size 2" in table.stdout
    for node in nodes:
        node.kill()


def test_status_of_unknown_run_and_unreachable_etcd(etcd: EtcdServer) -> None:
    result = run("-m", "elastic_tools.cli", "status", "--etcd", etcd.endpoint, "--run-id", "nobody")
    assert result.returncode == 0 and "no rendezvous state" in result.stdout
    from elastic.etcd.server import free_port

    result = run(
        "-m", "elastic_tools.cli", "status", "--etcd", f"127.0.0.1:{free_port()}", "--run-id", "x"
    )
    assert result.returncode == 1 and "Could not reach etcd" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            [
                "--etcd",
                "h:1",
                "--run-id=j",
                "--nnodes=1:2",
                "--config",
                "c.yaml",
                "job.max_steps=5",
            ],
            [
                "--rdzv-endpoint",
                "h:1",
                "--rdzv-id=j",
                "--nnodes=1:2",
                "-m",
                "elastic_tools.training.worker",
                "--config",
                "c.yaml",
                "job.max_steps=5",
            ],
        ),
        (
            ["--etcd=h:1", "--standalone", "--node-addr", "10.0.0.2", "train.py", "--config", "x"],
            [
                "--rdzv-endpoint=h:1",
                "--standalone",
                "--local-addr",
                "10.0.0.2",
                "train.py",
                "--config",
                "x",
            ],
        ),
        (
            ["--config", "c.yaml", "--rdzv-conf", "join_timeout=9", "a.b=1"],
            [
                "--rdzv-conf",
                "join_timeout=9",
                "-m",
                "elastic_tools.training.worker",
                "--config",
                "c.yaml",
                "a.b=1",
            ],
        ),
        (
            ["--etcd=h:1", "-m", "elastic_tools.training.worker", "--config", "x", "a.b=1"],
            [
                "--rdzv-endpoint=h:1",
                "-m",
                "elastic_tools.training.worker",
                "--config",
                "x",
                "a.b=1",
            ],
        ),
    ],
)
def test_agent_option_spellings(argv: list[str], expected: list[str]) -> None:
    from elastic.agent.launch import translate_argv

    assert translate_argv(argv, {"--standalone", "-m", "--module"}) == expected


@pytest.mark.parametrize(
    ("argv", "warm_env", "warm"),
    [
        (["--config", "configs/tiny.yaml"], "1", True),
        (["--config", "configs/tiny.yaml"], "0", False),
        (["train.py", "--lr", "1"], "1", False),  # a user's script always starts fresh
    ],
)
def test_only_our_worker_starts_warm(
    argv: list[str], warm_env: str, warm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.run import config_from_args, get_args_parser

    from elastic import env
    from elastic.agent import warm as warm_module
    from elastic.agent.launch import _warm_entrypoint, translate_argv
    from elastic.agent.run_script import wrap_args

    started: list[bool] = []
    monkeypatch.setattr(warm_module, "start_server", lambda: started.append(True))
    monkeypatch.setenv(env.WARM_START, warm_env)
    args = get_args_parser().parse_args(translate_argv(["--nnodes=1", *argv], set()))
    config, cmd, cmd_args = config_from_args(args)
    entrypoint, new_args = _warm_entrypoint(args, config, cmd, cmd_args)
    assert (entrypoint is warm_module.run_worker) == warm
    assert bool(started) == warm
    assert config.start_method == ("forkserver" if warm else "spawn")
    if warm:
        assert new_args == ["--config", "configs/tiny.yaml"]
    elif argv[0] == "train.py":  # through the tutorial-script guard (run_script)
        assert (entrypoint, new_args) == (cmd, wrap_args(cmd_args))
        assert new_args[:4] == ["-u", "-m", "elastic.agent.run_script", "train.py"]
    else:
        assert (entrypoint, new_args) == (cmd, cmd_args)


@pytest.mark.slow
def test_sigterm_while_the_agent_waits_for_its_job_leaves_with_0(
    tmp_path: Path, etcd: EtcdServer, run_id: str
) -> None:
    script = REPO / "examples" / "tutorial" / "train.py"
    options = {"nnodes": "2", "nproc": 1, "rdzv_conf": FAST_CONF}  # the second node never comes
    environ = node_env(LOGLEVEL="INFO")
    with local_cluster(tmp_path / "run", etcd.endpoint, run_id, environ, **options) as cluster:
        node = cluster.start("a", worker=[str(script)])
        wait_until(lambda: "Rendezvous'ing worker group" in node.output(), 180, "the rendezvous")
        node.kill(signal.SIGTERM)
        code = node.wait(30)  # before: killed by the signal (-15)
    assert code == 0, node.output()[-3000:]
    assert node.output().rstrip().endswith("elastic-agent: left the job on SIGTERM.")


def test_a_stop_signal_before_torchs_agent_is_a_clean_leave(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from elastic.agent import launch

    with pytest.raises(SignalException) as raised:
        launch._on_stop_signal(signal.SIGTERM, None)
    assert launch._stop_signal(raised.value) is signal.SIGTERM
    monkeypatch.delitem(sys.modules, launch._TORCH_API)  # torch not imported yet
    with pytest.raises(BaseException) as early:
        launch._on_stop_signal(signal.SIGHUP, None)
    assert launch._stop_signal(early.value) is signal.SIGHUP
    assert launch._stop_signal(ValueError("x")) is None
