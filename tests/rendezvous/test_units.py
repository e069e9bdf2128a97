"""Pure logic: state framing, option validation. No etcd."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic.errors import ConfigError, EtcdStateError
from elastic.etcd.client import Endpoint, EtcdOptions
from elastic.rendezvous.backend import decode_state, encode_state
from elastic.rendezvous.keys import RunKeys
from elastic.rendezvous.options import FAST_FAILOVER, FAST_FAILOVER_CONF, RendezvousOptions


def params(endpoint: str = "127.0.0.1:2379", **conf: object) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, "job", 1, 2, **conf)


def test_state_round_trip_and_corruption() -> None:
    blob = encode_state(b"payload")
    assert decode_state(blob, b"/k") == b"payload"
    for bad in (b"", b"garbage", blob[:-1] + b"X", b"EV3\x09" + blob[4:]):  # \x02: signed
        with pytest.raises(
            EtcdStateError, match=r"^The rendezvous state at etcd key '/k' is corrupt"
        ):
            decode_state(bad, b"/k")


def test_options_validation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    eps = [Endpoint("h", 1)]
    with pytest.raises(ConfigError, match="user and its password"):
        EtcdOptions(eps, user="u")
    with pytest.raises(ConfigError, match="certificate and its key"):
        EtcdOptions(eps, cert="c.pem")
    with pytest.raises(ConfigError, match="does not exist"):
        EtcdOptions(eps, ca_cert=str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError, match="positive"):
        EtcdOptions(eps, request_timeout=0)


def etcd_options(p: RendezvousParameters) -> EtcdOptions:
    return RendezvousOptions.from_params(p).etcd_options(p.endpoint)


def check_keep_alive(p: RendezvousParameters) -> None:
    RendezvousOptions.from_params(p)


def test_etcd_options_from_params() -> None:
    opts = etcd_options(params("https://a:1,b:2", user="u", password="p", request_timeout="7"))
    assert [str(e) for e in opts.endpoints] == ["a:1", "b:2"]
    assert opts.secure and opts.user == "u" and opts.request_timeout == 7.0
    with pytest.raises(ConfigError, match="protocol 'gopher'"):
        etcd_options(params(protocol="gopher"))
    assert not etcd_options(params("https://a:1", protocol="http")).secure


def test_options_have_one_set_of_defaults_and_a_fast_failover_profile() -> None:
    default = RendezvousOptions.from_params(params())
    assert default == RendezvousOptions()
    assert (default.keep_alive_interval, default.keep_alive_max_attempt) == (5, 3)
    fast = RendezvousOptions.from_params(params(profile=FAST_FAILOVER, join_timeout="90"))
    assert (fast.last_call_timeout, fast.keep_alive_interval, fast.keep_alive_max_attempt) == (
        1,
        1,
        3,
    )
    assert fast.join_timeout == 90
    tuned = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
    assert tuned == FAST_FAILOVER_CONF
    explicit = RendezvousOptions.from_params(params(profile=FAST_FAILOVER, keep_alive_interval="2"))
    assert explicit.keep_alive_interval == 2, "an explicit option wins over the profile"
    # torch's launcher sets these for every backend: accepted, ignored
    RendezvousOptions.from_params(params(timeout="900", rank="-1"))


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"ttl": "-5"}, "ttl=-5 must be a positive number"),
        ({"keep_alive_interval": "abc"}, "keep_alive_interval='abc' is not a number"),
        ({"keep_alive_max_attempt": "2.5"}, "is not a whole number"),
        ({"profile": "turbo"}, "profile 'turbo' is unknown"),
        ({"keepalive_interval": "1"}, "Unknown rendezvous option"),
        # numbers at their limits (issue 18): float() takes inf and nan
        ({"last_call_timeout": "nan"}, "last_call_timeout=nan is out of range"),
        ({"close_timeout": "-1"}, "close_timeout=-1.0 is out of range"),
        ({"keep_alive_interval": "inf"}, "keep_alive_interval=inf is out of range"),
        ({"ttl": "9223372036854775808"}, "ttl=9223372036854775808 is out of range"),
    ],
)
def test_bad_options_are_one_sentence(conf: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RendezvousOptions.from_params(params(**conf))


def test_options_repr_hides_the_password() -> None:
    opts = RendezvousOptions.from_params(params(user="u", password="s3cret"))
    assert "s3cret" not in repr(opts) and "***" in repr(opts)


@pytest.mark.parametrize(("interval", "attempts"), [(1, 2), (1, 1), (0, 5), (2, 1)])
def test_keep_alive_settings_that_risk_split_brain_are_refused(
    interval: int, attempts: int
) -> None:
    with pytest.raises(ConfigError, match="split brain"):
        check_keep_alive(params(keep_alive_interval=interval, keep_alive_max_attempt=attempts))


def test_keep_alive_defaults_and_tuned_values_pass() -> None:
    check_keep_alive(params())
    check_keep_alive(params(keep_alive_interval=1, keep_alive_max_attempt=3))


def test_run_keys() -> None:
    keys = RunKeys("/elastic", "job")
    assert keys.state == b"/elastic/job/rdzv/state"
    assert keys.store == b"/elastic/job/store/"
    for bad_prefix, bad_run in (("/p", ""), ("/p", "a/b"), ("p", "job")):
        with pytest.raises(ConfigError):
            RunKeys(bad_prefix, bad_run)


def test_the_password_comes_from_a_file_or_the_environment_never_stays_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elastic.etcd import credentials

    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    assert RendezvousOptions.parse({"user": "u", "password_file": str(secret)}).password == (
        "from-file"
    )
    with pytest.raises(ConfigError, match="Cannot read the etcd password file"):
        RendezvousOptions.parse({"user": "u", "password_file": str(tmp_path / "none")})
    monkeypatch.setenv("ELASTIC_ETCD_PASSWORD", "from-env")
    monkeypatch.setattr(credentials, "_env_password", None)
    credentials.take_password_from_env()
    assert "ELASTIC_ETCD_PASSWORD" not in os.environ, "children would inherit it"
    assert RendezvousOptions.parse({"user": "u"}).password == "from-env"


def test_torchs_own_c10d_options_are_accepted_and_ignored() -> None:
    """torch's local_elastic_agent tests and recipes pass ``is_host`` to any backend."""
    opts = RendezvousOptions.parse({"is_host": "true", "timeout": "30", "rank": "0"})
    assert opts == RendezvousOptions.parse({})
