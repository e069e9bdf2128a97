"""The ``etcd-v3`` rendezvous options, parsed once into one frozen, validated object.

Options come from ``--rdzv-conf key=value,...`` (torch's ``RendezvousParameters``). Ours:

==================  ==========================================================
profile             a named set of defaults; ``fast-failover`` (see
                    :data:`PROFILES`) is the tuned set our tests, demo and
                    compose use. Options given explicitly win over it.
protocol            ``http`` (default) or ``https``
cacert              CA bundle (PEM) that signed the etcd server certificates
cert, key           client certificate and key (PEM) for mutual TLS
user                etcd user (etcd's auth enabled); its password from
                    ``password_file`` (a file), else ``$ELASTIC_ETCD_PASSWORD``
                    (taken out of the environment as the agent starts, so no
                    child inherits it). ``password=...`` works but shows in
                    ``ps``: a warning says so.
prefix              key prefix, default ``/elastic``; state at prefix/run_id/
ttl                 seconds an abandoned run's keys live; default 7200
connect_timeout     seconds to reach etcd the first time; default 5
request_timeout     seconds a request rides out an etcd outage; default 30
store_timeout       seconds a blocking store read waits; default 300
outage_timeout      seconds a running job rides out an unreachable etcd before the
                    agent gives up; default 600 (training goes on meanwhile)
algorithm           ``announce`` (default: one key per node on its own lease, a
                    closer publishes each round; O(1) requests per node, scales
                    to 1,000 nodes, see :mod:`elastic.rendezvous.announce`) or
                    ``single-key`` (torch's stock handler, all state in one
                    key, see :mod:`elastic.rendezvous.handler`)
==================  ==========================================================

and torch's standard ones: ``join_timeout`` (600), ``last_call_timeout`` (30),
``close_timeout`` (30), ``heartbeat_timeout`` (5), ``keep_alive_interval`` (5) and
``keep_alive_max_attempt`` (3). ``timeout`` and ``rank`` (set by torch's launcher for
other backends) are accepted and ignored; anything else is refused with a sentence.
``elastic-agent`` also takes the node's options here (``straggler.ratio=2``, the keys of
:mod:`elastic.node.options`) and takes them out before the rendezvous sees the rest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic import env
from elastic.etcd.credentials import password_from_env
from elastic.node import options as node_options

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    from elastic.etcd.client import EtcdOptions

logger = logging.getLogger(__name__)

FAST_FAILOVER = "fast-failover"
# The tuned settings: a crash is noticed within 3 s of missed heartbeats (sooner through
# the probe port), and a round closes 1 s after the last node joined.
PROFILES: dict[str, dict[str, str]] = {
    FAST_FAILOVER: {
        "last_call_timeout": "1",
        "keep_alive_interval": "1",
        "keep_alive_max_attempt": "3",
    },
}
# The same settings as an --rdzv-conf string, for backends without profiles (c10d baselines).
FAST_FAILOVER_CONF = ",".join(f"{k}={v}" for k, v in PROFILES[FAST_FAILOVER].items())

# Heartbeats judged missing after interval x attempts; below this a busy node is
# declared dead while alive (a split brain seen with 1 s x 2 on a 2-core machine).
MIN_KEEP_ALIVE_ATTEMPTS = 3
MIN_KEEP_ALIVE_WINDOW_S = 3
SINGLE_KEY = "single-key"
ANNOUNCE = "announce"
ALGORITHMS = (SINGLE_KEY, ANNOUNCE)
# Set by torch's launcher for every backend ("timeout", "rank"), or torch's own c10d options
# its tests and recipes pass to any backend ("is_host": whether this node hosts the c10d
# TCPStore; ours lives in etcd, and each round's bootstrap store is rank 0's agent's).
_IGNORED = frozenset({"timeout", "rank", "is_host"})


# The largest number any option takes (about 115 days in seconds): beyond it a value is a
# typo, and inf/nan (which float() accepts) are never meant.
MAX_OPTION_VALUE = 10_000_000


@dataclass(frozen=True)
class RendezvousOptions:
    """Every option of the ``etcd-v3`` rendezvous, with its one default."""

    protocol: str | None = None  # None: https if the endpoint says https://, else http
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    prefix: str = "/elastic"
    ttl: int = 7200
    connect_timeout: float = 5.0
    request_timeout: float = 30.0
    store_timeout: float = 300.0
    outage_timeout: float = 600.0
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    heartbeat_timeout: float = 5.0
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3
    algorithm: str = ANNOUNCE

    def __repr__(self) -> str:  # never show the password
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "password"}
        secret = "***" if self.password else None
        return f"RendezvousOptions({shown}, password={secret})"

    def __post_init__(self) -> None:
        from elastic.errors import ConfigError

        if self.protocol not in (None, "http", "https"):
            raise ConfigError(f"The etcd protocol '{self.protocol}' is invalid; use http or https.")
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(
                f"The rendezvous algorithm '{self.algorithm}' is unknown; use "
                f"{' or '.join(ALGORITHMS)}."
            )
        for name in (
            "ttl",
            "connect_timeout",
            "request_timeout",
            "store_timeout",
            "outage_timeout",
            "join_timeout",
        ):  # keep_alive_*: the split-brain rule below
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"The rendezvous option {name}={getattr(self, name)} must be "
                    "a positive number; fix --rdzv-conf."
                )
        for f in fields(self):  # every number: finite, not negative, within a sane bound
            value = getattr(self, f.name)
            if isinstance(value, int | float) and not 0 <= value <= MAX_OPTION_VALUE:
                raise ConfigError(
                    f"The rendezvous option {f.name}={value} is out of range: use a number "
                    f"from 0 to {MAX_OPTION_VALUE:g} (seconds, or a count); fix --rdzv-conf."
                )
        window = self.keep_alive_interval * self.keep_alive_max_attempt
        if (
            self.keep_alive_max_attempt < MIN_KEEP_ALIVE_ATTEMPTS
            or window < MIN_KEEP_ALIVE_WINDOW_S
        ):
            raise ConfigError(
                f"keep_alive_interval={self.keep_alive_interval:g} with keep_alive_max_attempt="
                f"{self.keep_alive_max_attempt} declares a node dead after {window:g} s of missed "
                f"heartbeats, which risks a split brain; use at least {MIN_KEEP_ALIVE_ATTEMPTS} "
                f"attempts and {MIN_KEEP_ALIVE_WINDOW_S} s in all."
            )

    @classmethod
    def parse(cls, conf: dict[str, Any], endpoint: str = "") -> RendezvousOptions:
        """Parse ``--rdzv-conf`` (a dict of strings); raise ``ConfigError`` naming a bad one.

        ``endpoint`` (``--rdzv-endpoint``) says whether a password would travel over TLS
        when no ``protocol`` is given (``https://``), for the warning when it would not.
        """
        from elastic.errors import ConfigError

        conf = {k: v for k, v in conf.items() if k not in _IGNORED and v is not None}
        profile = str(conf.pop("profile", "") or "")
        if profile and profile not in PROFILES:
            raise ConfigError(
                f"The rendezvous profile '{profile}' is unknown; use one of "
                f"{', '.join(sorted(PROFILES))}."
            )
        merged = {**PROFILES.get(profile, {}), **conf}
        known = {f.name: f for f in fields(cls)}
        node = sorted(set(merged) & node_options.KEYS)
        if node:
            raise ConfigError(
                f"The node option(s) {', '.join(node)} in --rdzv-conf are read by elastic-agent "
                "only; start the node with elastic-agent, or set "
                f"{', '.join('$' + env.option(k) for k in node)}."
            )
        unknown = sorted(set(merged) - set(known) - {"password_file"})
        if unknown:
            raise ConfigError(
                f"Unknown rendezvous option(s) {', '.join(unknown)}; see "
                "'elastic-agent --help' and the README for the options."
            )
        password_file = merged.pop("password_file", None)
        values = {name: _convert(name, known[name].type, raw) for name, raw in merged.items()}
        if values.get("password"):
            logger.warning(
                "The etcd password given as password=... shows in 'ps' and in "
                "torch's logs; use password_file=FILE or $%s.",
                env.ETCD_PASSWORD,
            )
        elif password_file:
            values["password"] = _read_password(str(password_file))
        elif values.get("user") and password_from_env():
            values["password"] = password_from_env()
        options = cls(**values)
        if options.password and not options.uses_tls(endpoint):
            logger.warning(
                "The etcd password travels unencrypted (plain http); use an https:// "
                "endpoint or protocol=https, with cacert= for TLS."
            )
        return options

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> RendezvousOptions:
        return cls.parse(dict(params.config), params.endpoint)

    def uses_tls(self, endpoint: str) -> bool:
        """Whether the client for ``endpoint`` speaks TLS: ``protocol`` if given, else
        whether the endpoint says ``https://``."""
        if self.protocol:
            return self.protocol == "https"
        from elastic.etcd.client import parse_endpoints

        return parse_endpoints(endpoint or "localhost")[1]

    def etcd_options(self, endpoint: str) -> EtcdOptions:
        """Client options for ``--rdzv-endpoint`` with these TLS/auth settings."""
        from elastic.etcd.client import EtcdOptions, parse_endpoints

        endpoints, _ = parse_endpoints(endpoint or "localhost")
        return EtcdOptions(
            endpoints=endpoints,
            tls=self.uses_tls(endpoint),
            ca_cert=self.cacert,
            cert=self.cert,
            key=self.key,
            user=self.user,
            password=self.password,
            connect_timeout=self.connect_timeout,
            request_timeout=min(self.request_timeout, self.outage_timeout),
        )

    def timeouts(self) -> RendezvousTimeout:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

        return RendezvousTimeout(
            *(
                timedelta(seconds=s)
                for s in (
                    self.join_timeout,
                    self.last_call_timeout,
                    self.close_timeout,
                    self.heartbeat_timeout,
                )
            )
        )


def _read_password(path: str) -> str:
    from elastic.errors import ConfigError

    try:
        password = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"Cannot read the etcd password file {path} ({exc.strerror}); "
            "fix password_file= in --rdzv-conf."
        ) from exc
    if not password:
        raise ConfigError(f"The etcd password file {path} is empty; write the password in it.")
    return password


def _convert(name: str, kind: Any, raw: Any) -> Any:
    from elastic.errors import ConfigError

    kind = str(kind)
    try:
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
    except (TypeError, ValueError) as exc:
        what = "a whole number" if kind.startswith("int") else "a number"
        raise ConfigError(
            f"The rendezvous option {name}={raw!r} is not {what}; fix --rdzv-conf."
        ) from exc
    return raw if raw is None else str(raw).lower() if name == "protocol" else str(raw)


__all__ = [
    "ALGORITHMS",
    "ANNOUNCE",
    "FAST_FAILOVER",
    "FAST_FAILOVER_CONF",
    "PROFILES",
    "SINGLE_KEY",
    "RendezvousOptions",
]
