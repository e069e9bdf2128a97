"""Exit codes shared by the worker, the agent and the CLIs."""

OK = 0
FAILED = 1  # a runtime or checkpoint failure; also "etcd unreachable" for the CLIs
USAGE = 2  # bad input: a config file, a flag, an option value
# A worker that stopped because a *peer* asked the group to stop (a planned leave
# elsewhere). Its agent re-forms the group instead of counting a failure (EX_TEMPFAIL).
REFORM = 75

__all__ = ["FAILED", "OK", "REFORM", "USAGE"]
