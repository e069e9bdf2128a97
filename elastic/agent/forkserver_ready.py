"""Imported last by the warm-start fork server (see :mod:`elastic.agent.forkserver`): the
server's imports are done; freeze its heap for the workers it forks.

:mod:`elastic.agent.forkserver_init` (imported first) turns the cyclic garbage collector
off while the server imports, as the agent does around its own import of torch: imports
make objects that live as long as the process, and each collection pass over them is work
thrown away (0.2-0.3 s of a 1.3-1.6 s import of torch here). Here the collector moves every
object the imports made to its permanent generation (:func:`gc.freeze`) and starts again.
A worker forked from the server then never walks those objects in its own collections:
a walk writes to each object's header, so it would copy, page by page, the memory the
worker shares with the server (Python's documentation gives the same recipe for a
process that forks without exec). The cost: the few cyclic garbage objects the imports
left (about 7,000 after ``import torch``) are never freed.
"""

import gc

gc.freeze()
gc.enable()
