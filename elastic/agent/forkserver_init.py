"""Imported by the warm-start fork server as it starts (see :mod:`elastic.agent.forkserver`):
tie its life to the agent's.

Python's fork server exits when every holder of its "alive" pipe has closed it, and every
process it forks holds that pipe too. So after a ``kill -9`` of the agent its workers would
keep the server alive, and the server (their parent) keeps them alive: a worker could go on
training with its peers without an agent (seen: 3 s, until the rendezvous dropped the dead
node). Asking Linux to kill the server when the agent dies breaks that loop; each worker
in turn dies with the server.

It also turns the cyclic garbage collector off while the server imports:
:mod:`elastic.agent.forkserver_ready`, imported last, freezes what the imports made and
turns it on again.
"""

import gc
import multiprocessing
import os

from elastic import env
from elastic.node.procs import die_with_parent

gc.disable()  # until elastic.agent.forkserver_ready: the server only imports
die_with_parent()
# Forked workers inherit this: they check that the server is still their parent when
# they ask to die with it (it may have died between their fork and that request).
os.environ[env.FORK_SERVER_PID] = str(os.getpid())
# The server's own process object is multiprocessing's main process: a user's script forked
# from here gets a fresh one (elastic.agent.plain_script), as if it had started on its own.
MAIN_PROCESS = type(multiprocessing.current_process())
