"""The node: the one medium between an agent and its workers, and the node's processes.

* :mod:`~elastic.node.nodelocal`: the agent's private directory in ``/dev/shm``;
* :mod:`~elastic.node.channel`: the in-place channel files (assignments down, requests up);
* :mod:`~elastic.node.notify`: the wake-up between them;
* :mod:`~elastic.node.reform`: the exit codes and the stop marker;
* :mod:`~elastic.node.procs`, :mod:`~elastic.node.memlimit`: process helpers.

An agent and a worker both import this package; neither imports the other.
"""

__all__: list[str] = []
