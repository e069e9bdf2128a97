"""Exit codes, and the re-form protocol that the worker, the agent and the handler share.

A *re-form* is a change of membership that is not a failure: it costs no restart.

1. **A planned leave.** SIGTERM reaches one node's agent. torch forwards it to that node's
   workers; ours finish the current step, save with their peers and exit :data:`OK`
   (:mod:`elastic.training.worker`). Their peers see the group stop early and exit
   :data:`EXIT_CODE`. The leaving agent removes its node from the rendezvous at once
   (:meth:`elastic.rendezvous.handler.EtcdRendezvousHandler.leave`).
2. **A changed round.** The surviving agents ask their handler for a
   :meth:`~elastic.rendezvous.handler.EtcdRendezvousHandler.membership_change` every
   monitor tick: a joiner waiting, a peer gone (crash, cut link, left), or this node dropped.
3. **Restart without spending the budget.** A worker group whose every failure is
   :data:`EXIT_CODE` re-runs the rendezvous without counting a failure
   (:class:`agents.agent.NodeAgent`). A warm (forked) worker stopped by a signal also exits
   :data:`EXIT_CODE` (:func:`agents.warm.run_worker`), since torch would otherwise wait for
   its return value.
4. **A lost peer.** Workers blocked in a collective with a vanished peer cannot hear a stop
   request: the agent gives them :data:`agents.agent.LOST_PEER_GRACE_S`, then kills them.
"""

OK = 0
FAILED = 1  # a runtime or checkpoint failure; also "etcd unreachable" for the CLIs
USAGE = 2  # bad input: a config file, a flag, an option value
# A worker that stopped because a *peer* asked the group to stop (a planned leave
# elsewhere). Its agent re-forms the group instead of counting a failure (EX_TEMPFAIL).
EXIT_CODE = 75

__all__ = ["EXIT_CODE", "FAILED", "OK", "USAGE"]
