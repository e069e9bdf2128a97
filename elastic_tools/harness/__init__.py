"""The test and bench harness: local agents driven as a cluster, and network faults.

* :mod:`elastic_tools.harness.cluster`: :class:`LocalCluster` starts, stops and kills local
  ``elastic-agent`` nodes and waits for their events (``elastic demo``, ``elastic chaos``,
  ``bench/``, the tests); :data:`REPO` and :func:`provenance` for results files;
* :mod:`elastic_tools.harness.faults`: :class:`Net`, nodes in network namespaces and a cut link
  (``elastic chaos``, ``tests/multinode``).
"""

from elastic_tools.harness.cluster import (
    REPO,
    AgentOptions,
    LocalCluster,
    Node,
    WaitTimeout,
    agent_env,
    membership_scenario,
    provenance,
    pythonpath,
)
from elastic_tools.harness.faults import Net, netns_usable

__all__ = [
    "REPO",
    "AgentOptions",
    "LocalCluster",
    "Net",
    "Node",
    "WaitTimeout",
    "agent_env",
    "membership_scenario",
    "netns_usable",
    "provenance",
    "pythonpath",
]
