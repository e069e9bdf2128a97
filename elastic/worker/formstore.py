"""A round's bootstrap store whose blocking waits a newer round cuts short.

Forming a gloo group (the round's default group, then the checkpoints' side group) waits in
the store for every rank's address. A rank that dies before it writes its address would
hold the others there for the whole store timeout (minutes), deaf to the newer round its
agent forms at once: a TCPStore wait cannot be interrupted from another thread, and a
worker stuck in C++ runs no signal handler either (seen: a node killed while a joiner's
side group formed held both survivors 10 minutes, then past their agents' end).

:class:`FormingStore` waits by polling ``check`` and calls ``interrupt`` between polls;
``interrupt`` raises to give up (the member raises
:class:`~elastic.worker.exchange.Interrupted` once a newer round is formed), and the
exception reaches the caller of ``init_process_group``/``new_group`` unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

FAST_POLL_S = 0.002  # a wait's first FAST_FOR_S: peers' keys usually come within ms
FAST_FOR_S = 0.25
SLOW_POLL_S = 0.02  # then: how soon a newer round is seen
GONE_WAIT_S = 30.0  # how long a wait on a store that went away waits for the newer round


class FormingStore(dist.Store):
    """``inner`` with waits that call ``interrupt()`` (which raises to give up) while they
    poll; every other operation goes straight to ``inner``. ``wait_s`` is the least a wait
    lasts whatever its caller asks: gloo asks its short connect timeout
    (:data:`elastic.worker.groups.FORM_TIMEOUT`), while a peer that is merely slow to
    reach the formation must still be waited for, and ``interrupt`` ends a hopeless wait."""

    def __init__(
        self, inner: dist.Store, interrupt: Callable[[], None], wait_s: float = 0.0
    ) -> None:
        super().__init__()  # required for the pybind trampoline
        self._inner = inner
        self._interrupt = interrupt
        self._wait_s = wait_s
        self._gone: tuple[Exception, float] | None = None  # (the inner store's error, when)

    def set(self, key: str, value: bytes | str) -> None:
        self._inner.set(key, value)  # type: ignore[arg-type]  # bytes too, at run time

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._inner.get(key)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._inner.compare_set(key, expected, desired)  # type: ignore[arg-type]

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Return once every key is set; ``interrupt()`` is called between polls.

        Raises:
            torch.distributed.DistStoreError: the keys did not come within ``timeout`` (the
                inner store's own timeout when None), or ``wait_s`` when longer.
        """
        inner_timeout: timedelta = self._inner.timeout  # type: ignore[attr-defined]
        limit = (timeout if timeout is not None else inner_timeout).total_seconds()
        limit = max(limit, self._wait_s) if limit > 0 else float("inf")  # 0: kNoTimeout
        started = time.monotonic()
        while not self._check(keys):
            self._interrupt()
            waited = time.monotonic() - started
            if waited > limit:
                raise dist.DistStoreError(
                    f"The keys {keys} were not set within {limit:.0f} s: a rank of the "
                    "round never reached the group's formation."
                )
            time.sleep(FAST_POLL_S if waited < FAST_FOR_S else SLOW_POLL_S)

    def _check(self, keys: list[str]) -> bool:
        """Whether every key is set. A store that went away (its agent forms the next round
        and closes this one's) is asked no more: the wait then lasts until ``interrupt``
        sees that round, or :data:`GONE_WAIT_S` without one re-raises the store's error."""
        if self._gone is None:
            try:
                return self._inner.check(keys)
            except Exception as exc:
                self._gone = (exc, time.monotonic())
        error, since = self._gone
        if time.monotonic() - since > GONE_WAIT_S:
            raise error
        return False


__all__ = ["FormingStore"]
