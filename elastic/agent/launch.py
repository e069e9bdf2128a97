"""``elastic-agent``: torchrun's agent with the ``etcd-v3`` rendezvous and clear errors.

Takes torchrun's options (``--nnodes MIN:MAX``, ``--nproc-per-node``,
``--rdzv-endpoint``, ``--rdzv-id``, ``--max-restarts``, ``--local-addr`` ...) with
``--rdzv-backend`` defaulting to ``etcd-v3``, and runs any training script the way
torchrun does. Bad input and an unreachable etcd end in one sentence on stderr
and a non-zero exit, not a traceback.

``--metrics-port N`` (or ``$ELASTIC_METRICS_PORT``; 0: a free port, printed) serves the
agent's Prometheus metrics on ``http://<host>:N/metrics`` (:mod:`elastic.agent.metrics`).

Every option of :mod:`elastic.node.options` is a flag (``--straggler-ratio 2``), a
``--rdzv-conf`` key (``straggler.ratio=2``) and a variable (``$ELASTIC_STRAGGLER_RATIO``);
flags win over ``--rdzv-conf``, which wins over ``--options-file FILE`` (YAML), which wins over
the environment. The agent hands the
result to its workers as those variables.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from elastic import env
from elastic.node import options, reform

logger = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one node's agent until its workers finish; return the exit code."""
    from elastic.etcd.credentials import take_password_from_env

    # First: out of os.environ before any child copies it, and wiped from /proc/<pid>/environ.
    take_password_from_env()
    own_process = argv is None  # the command itself, not a caller in this process
    argv = list(sys.argv[1:] if argv is None else argv)
    # Before the fork server starts: it takes this environment for the workers.
    private_log = _event_log_for_workers() if _may_serve_metrics(argv) else None
    previous = _leave_on_signals()
    stopped = False
    try:
        code = _main(argv)
    except BaseException as exc:
        stop = _stop_signal(exc)
        if stop is None:
            raise
        code, stopped = _left(stop), True
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if private_log:
            from elastic.agent import metrics

            metrics.remove_private_log(private_log)
    if stopped and own_process:
        _exit_now(code)
    return code


def _main(argv: list[str]) -> int:
    _start_warm_server_early(argv)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    from elastic.agent.node import install
    from elastic.errors import ConfigError, ElasticError

    install()

    parser = build_parser(get_args_parser())
    flags = {o for a in parser._actions if a.nargs == 0 for o in a.option_strings}
    args = parser.parse_args(translate_argv(argv, flags))
    try:
        port = metrics_port(args.metrics_port)
        given = given_options(args)
        _preflight_worker_config(args)
    except ValueError as exc:  # a ConfigError too
        return _fail(str(exc), reform.USAGE)
    try:
        config, cmd, cmd_args = config_from_args(args)
    except (AssertionError, ValueError) as exc:  # torchrun's checks of --nnodes and friends
        return _fail(f"{exc}; check the command-line options.", reform.USAGE)
    # the straggler policy never drops the job below --nnodes MIN (elastic.worker.straggler)
    given.setdefault("straggler.min_nodes", str(config.min_nodes))
    try:
        hand_to_workers(options.build(given))
    except ConfigError as exc:
        return _fail(str(exc), reform.USAGE)
    entrypoint, cmd_args = _warm_entrypoint(args, config, cmd, cmd_args)
    exporter = None if port is None else _start_metrics(port, config)
    try:
        elastic_launch(config=config, entrypoint=entrypoint)(*cmd_args)
    except ConfigError as exc:
        return _fail(str(exc), reform.USAGE)
    except (ElasticError, RendezvousError) as exc:
        return _fail(_describe(exc), reform.FAILED)
    except ChildFailedError as exc:
        from elastic.agent import failure

        log_dir = getattr(config.logs_specs, "_run_log_dir", None)  # torch's, once made
        line = failure.describe(failure.node_label(config.local_addr), exc.failures, log_dir)
        return _fail(line, reform.FAILED)
    finally:
        if exporter is not None:
            exporter.close()
    return 0


_METRICS_OPTIONS = ("--metrics-port", "--metrics_port")
_ETCD_DEFAULT = "localhost:2379"
_OWN_SPELLINGS = (
    (
        "--etcd",
        "ENDPOINTS",
        f"etcd endpoint(s) host:port[,host:port] (--rdzv-endpoint); default: {_ETCD_DEFAULT}",
    ),
    ("--run-id", "ID", "the job's id, the same on every node (--rdzv-id); default: none"),
    (
        "--node-addr",
        "ADDR",
        "this node's address other nodes reach (--local-addr); default: this host's name",
    ),
    (
        "--config",
        "FILE",
        "run our CNN worker with this YAML config (no script given); default: none",
    ),
)


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """torchrun's ``parser`` as ``elastic-agent``'s: the ``etcd-v3`` backend, our spellings
    and every option of :mod:`elastic.node.options`, each with its default in ``--help``."""
    parser.prog = "elastic-agent"
    # The script's own flags follow it (--snapshot would otherwise abbreviate --snapshot-every).
    parser.allow_abbrev = False
    parser.set_defaults(rdzv_backend="etcd-v3")
    own = parser.add_argument_group(
        "elastic-agent", "Our spellings of torchrun's options (both work)."
    )
    for name, metavar, text in _OWN_SPELLINGS:  # translate_argv rewrites them before parsing
        own.add_argument(name, metavar=metavar, dest=f"own_{name[2:]}", help=text)
    own.add_argument(
        "--options-file",
        metavar="FILE",
        default=None,
        help="a YAML file of the options below, e.g. 'straggler: {drop: on, ratio: 2}'; "
        "--rdzv-conf and the flags win over it, it wins over the environment; default: none",
    )
    group = parser.add_argument_group(
        "options",
        "Each is also --rdzv-conf KEY=VALUE, a key of --options-file and $ELASTIC_<KEY>; "
        "flags win, then --rdzv-conf, then the file, then the environment. See "
        "docs/operations.md#options.",
    )
    for option in options.OPTIONS:
        names = list(_METRICS_OPTIONS) if option.key == "metrics_port" else [option.flag]
        shown = option.default if option.default not in (None, "") else "unset"
        if option.on_off:
            shown = "on" if option.default else "off"
        text = f"{option.description} (key {option.key}; ${option.env}; default: {shown})"
        dest = "metrics_port" if option.key == "metrics_port" else _dest(option.key)
        if option.on_off:
            group.add_argument(
                *names, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=text
            )
        else:
            group.add_argument(*names, dest=dest, metavar="VALUE", default=None, help=text)
    return parser


def _dest(key: str) -> str:
    return "option_" + key.replace(".", "__")


def given_options(args: argparse.Namespace) -> dict[str, str]:
    """The options set in the environment, ``--options-file``, ``--rdzv-conf`` and the flags
    (later wins), by key; takes ours out of ``args.rdzv_conf`` (torch's would refuse them).

    Raises:
        ConfigError: a value an option does not accept.
    """
    ours, rest = split_rdzv_conf(getattr(args, "rdzv_conf", "") or "")
    args.rdzv_conf = rest
    flags = {
        o.key: getattr(args, _dest(o.key))
        for o in options.OPTIONS
        if o.key != "metrics_port" and getattr(args, _dest(o.key), None) is not None
    }
    if args.metrics_port is not None:
        flags["metrics_port"] = args.metrics_port
    path = getattr(args, "options_file", None)
    in_file = options.from_file(path) if path else {}
    given = {**options.from_env(), **in_file, **ours, **flags}
    options.build(given)  # one sentence for a bad value, before anything starts
    return given


def split_rdzv_conf(conf: str) -> tuple[dict[str, str], str]:
    """``--rdzv-conf``'s node options (``straggler.ratio=2``) and the rest (the rendezvous's)."""
    ours: dict[str, str] = {}
    rest: list[str] = []
    for item in (p.strip() for p in conf.split(",")):
        key, _, value = item.partition("=")
        if key.strip() in options.KEYS:
            ours[key.strip()] = value.strip()
        elif item:
            rest.append(item)
    return ours, ",".join(rest)


def hand_to_workers(chosen: options.NodeOptions) -> None:
    """The options into this process's environment, where its workers (and the fork
    server's) read them; the old packed spellings out (said once, as the agent read them)."""
    for old in (env.STRAGGLER, env.HANG, env.PROBATION):
        os.environ.pop(old, None)
    os.environ.update(options.to_env(chosen))


# torch's agent handles these once its workers start (SIGQUIT aside); ours from the start
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_TORCH_API = "torch.distributed.elastic.multiprocessing.api"


class _Stopped(BaseException):
    """A stop signal that came before torch's agent took over its handling."""

    def __init__(self, sig: signal.Signals) -> None:
        super().__init__(sig.name)
        self.sig = sig


def _on_stop_signal(signum: int, frame: Any) -> None:
    """Raise what torch's own handler raises (its agent then leaves the rendezvous), or,
    before torch's agent is imported, :class:`_Stopped`."""
    sig = signal.Signals(signum)
    exc_type = getattr(sys.modules.get(_TORCH_API), "SignalException", None)
    if exc_type is not None:
        raise exc_type(f"Process {os.getpid()} got signal: {signum}", sigval=sig)
    raise _Stopped(sig)


def _leave_on_signals() -> dict[int, Any]:
    """A stop signal while the agent starts (imports, rendezvous) ends it as one later does:
    it leaves the job and exits 0 (not killed by the signal). Returns the handlers it
    replaced."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _on_stop_signal) for sig in _STOP_SIGNALS}


def _stop_signal(exc: BaseException) -> signal.Signals | None:
    """The signal that ``exc`` stands for, or None."""
    if isinstance(exc, _Stopped):
        return exc.sig
    exc_type = getattr(sys.modules.get(_TORCH_API), "SignalException", None)
    if exc_type is not None and isinstance(exc, exc_type):
        return signal.Signals(exc.sigval)
    return None


def _left(sig: signal.Signals) -> int:
    print(f"elastic-agent: left the job on {sig.name}.", file=sys.stderr)
    return 0


def _exit_now(code: int) -> None:
    """End the process after a stop signal without the interpreter's teardown: an etcd call
    the signal interrupted (a rendezvous in progress) keeps its gRPC channel busy until the
    call's deadline, and the channel's collection at exit waits for it (30 s measured)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _may_serve_metrics(argv: list[str]) -> bool:
    """Whether metrics may be on, before the options are parsed (a superset: the option
    anywhere, or the variable set); a wrong guess costs an unused private event log."""
    return bool(os.environ.get(env.METRICS_PORT, "").strip()) or any(
        a.partition("=")[0] in _METRICS_OPTIONS for a in argv
    )


def metrics_port(option: int | None) -> int | None:
    """``--metrics-port``, else ``$ELASTIC_METRICS_PORT``, else None (off).

    Raises:
        ValueError: the port is not a number from 0 to 65535.
    """
    value = str(option) if option is not None else os.environ.get(env.METRICS_PORT, "").strip()
    if not value:
        return None
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(
            f"--metrics-port (or ${env.METRICS_PORT}) must be a port number from 0 to 65535 "
            f"(0: any free port); got '{value}'."
        )
    return port


def _event_log_for_workers() -> str | None:
    """The exporter reads the workers' figures from their event log: make sure there is one."""
    from elastic.agent import metrics

    try:
        return metrics.event_log_for_workers()
    except OSError as exc:  # observability never stops training
        logger.warning("Cannot create a private event log (%s); no step metrics.", exc)
        return None


def _start_metrics(port: int, config: Any) -> Any:
    from elastic.agent import metrics

    exporter = metrics.start(
        port,
        addr=metrics.bind_address(config.local_addr),
        event_log=os.environ.get(env.EVENT_LOG),
        restart_budget=config.max_restarts,
        run_id=config.run_id,
    )
    if exporter is not None:
        print(
            f"elastic-agent: serving metrics on port {exporter.port} (/metrics).",
            file=sys.stderr,
            flush=True,
        )
    return exporter


ALIASES = {"--etcd": "--rdzv-endpoint", "--run-id": "--rdzv-id", "--node-addr": "--local-addr"}


def translate_argv(argv: list[str], flags: set[str]) -> list[str]:
    """Our spellings to torchrun's, and ``--config FILE`` (no script) to our CNN worker.

    ``--etcd``, ``--run-id`` and ``--node-addr`` are ``--rdzv-endpoint``,
    ``--rdzv-id`` and ``--local-addr``. Options before the first positional
    argument belong to the agent; a ``--config`` among them, with no script
    given, runs ``-m elastic_tools.training.worker --config FILE`` with the remaining
    ``section.key=value`` arguments. ``flags`` are the options that take no value.
    """
    out: list[str] = []
    tail: list[str] = []  # from the first positional argument on
    config: str | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in ALIASES:
            arg = ALIASES[name] + eq + value
        elif name == "--config":
            config = value if eq else argv[i + 1] if i + 1 < len(argv) else ""
            i += 1 if eq else 2
            continue
        elif not arg.startswith("-") or arg in ("-m", "--module"):
            tail = argv[i:]
            break
        takes_value = not eq and name not in flags and i + 1 < len(argv)
        out.extend([arg, argv[i + 1]] if takes_value else [arg])
        i += 2 if takes_value else 1
    if config is None:
        return out + tail
    # only positional section.key=value arguments are the worker's (an option's value,
    # such as --rdzv-conf k=v, stays the agent's)
    rest = [a for a in tail if "=" in a and not a.startswith("-")]
    others = [a for a in tail if a not in rest]
    return [*out, *others, "-m", "elastic_tools.training.worker", "--config", config, *rest]


def _start_warm_server_early(argv: list[str]) -> None:
    """Start the fork server as this process starts: a fork of it once it has imported torch.

    A guess from the raw arguments (our worker is named in them); :func:`_warm_entrypoint`
    decides for real once they are parsed. A wrong guess costs one idle server.
    """
    from elastic.agent import warm

    before_script = argv[: next((i for i, a in enumerate(argv) if a.endswith(".py")), len(argv))]
    ours = "elastic_tools.training.worker" in argv or any(
        a.partition("=")[0] == "--config" for a in before_script
    )
    if "--no-warm-start" in before_script or "--no-warm_start" in before_script:
        return
    if ours and warm.enabled():
        warm.fork_server()
    elif not ours:
        warm.start_early_for_script(argv)  # a user's script: when its rules allow


def _runs_our_worker(args: argparse.Namespace) -> bool:
    return bool(args.module and args.training_script == "elastic_tools.training.worker")


def _warm_entrypoint(
    args: argparse.Namespace, config: Any, cmd: Any, cmd_args: list[str]
) -> tuple[Any, list[str]]:
    """Workers fork from a fork server that has imported torch (see elastic.agent.warm):
    our worker, and a user's Python script where that is safe (else cold, logged once)."""
    from elastic.agent import warm

    if _runs_our_worker(args):
        if not warm.enabled() or args.no_python:
            return cmd, cmd_args
        config.start_method = warm.START_METHOD
        warm.start_server()
        return warm.run_worker, list(args.training_script_args)
    reason = warm.cold_reason(
        args.training_script, bool(args.module), bool(args.no_python), bool(args.run_path)
    )
    _note_tutorial_lines(args)
    if reason is not None or not isinstance(cmd, str):
        warm.note_cold(reason or "the entrypoint is not a command.")
        return cmd, guarded_args(cmd, cmd_args, bool(args.no_python))
    config.start_method = warm.START_METHOD
    # Started now, not early: torchrun's own changes to the environment (OMP_NUM_THREADS)
    # are made, so the server imports torch under the environment a fresh worker has.
    warm.start_server(warm.preload_for(args.training_script, bool(args.module)))
    logger.info("Workers of %s start warm (forked from the fork server).", args.training_script)
    script = warm.PlainScript(args.training_script, bool(args.module), cmd)
    return script, list(args.training_script_args)


def guarded_args(cmd: Any, cmd_args: list[str], no_python: bool) -> list[str]:
    """A cold worker of the agent's own interpreter starts through
    :mod:`elastic.agent.run_script`, which installs the tutorial-script guard
    (:mod:`elastic.agent.tutorial_check`) and then runs the script as ``python`` would."""
    if no_python or not isinstance(cmd, str):
        return cmd_args
    if os.path.realpath(cmd) != os.path.realpath(sys.executable):
        return cmd_args  # another interpreter ($PYTHON_EXEC) may not have this package
    from elastic.agent.run_script import wrap_args

    return wrap_args(cmd_args)


def _note_tutorial_lines(args: argparse.Namespace) -> None:
    """One warning at the start for a script written for ``mp.spawn`` (the workers then
    stop with one sentence when they reach that line)."""
    if args.module or args.no_python:
        return
    from elastic.agent.tutorial_check import scan

    found = scan(args.training_script)
    if found is not None:
        print(f"elastic-agent: warning: {found}", file=sys.stderr, flush=True)


def _preflight_worker_config(args: argparse.Namespace) -> None:
    """Validate our worker's config here, once, instead of in every worker and restart."""
    if not _runs_our_worker(args):
        return
    from elastic.errors import ConfigError

    # Our worker's own config module, loaded by name only when the command is our worker.
    load_config = importlib.import_module("elastic_tools.training.config").load_config

    worker_args = list(args.training_script_args)
    if "--config" not in worker_args or worker_args.index("--config") + 1 >= len(worker_args):
        raise ConfigError(
            "elastic_tools.training.worker needs --config FILE; pass the worker's YAML config."
        )
    at = worker_args.index("--config")
    overrides = [a for a in worker_args[at + 2 :] if "=" in a]
    load_config(worker_args[at + 1], overrides)


def _describe(exc: BaseException) -> str:
    """torch raises some rendezvous errors without a message: say what they mean."""
    from torch.distributed.elastic.rendezvous import (
        RendezvousClosedError,
        RendezvousTimeoutError,
    )

    if str(exc):
        return str(exc)
    if isinstance(exc, RendezvousTimeoutError):
        return (
            "the rendezvous did not complete within join_timeout (too few nodes came, or "
            "the job had already finished); check --nnodes and the other agents."
        )
    if isinstance(exc, RendezvousClosedError):
        return "the job's rendezvous is closed (the job finished or was shut down)."
    return type(exc).__name__


def _fail(message: str, code: int) -> int:
    print(f"elastic-agent: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
