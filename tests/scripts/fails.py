"""A worker that fails on purpose, for tests/agent/test_failure_line.py.

``fails.py MODE``: rank 1 writes two lines to stderr, then ends by MODE: ``exit`` (code 3),
``kill`` (SIGKILL to itself) or ``raise`` (an uncaught RuntimeError); rank 0 waits to be
stopped.
"""

from __future__ import annotations

import os
import signal
import sys
import time

mode = sys.argv[1]
if os.environ["RANK"] != "1":
    time.sleep(120)
    sys.exit(0)
print("loading the data set", file=sys.stderr, flush=True)
print(f"the last words of rank 1 ({mode})", file=sys.stderr, flush=True)
if mode == "exit":
    sys.exit(3)
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
raise RuntimeError("the batch had no labels")
