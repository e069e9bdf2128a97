"""The etcd password, kept out of every child's environment, argv and logs.

``$ELASTIC_ETCD_PASSWORD`` is taken out of the agent's environment as it starts
(:func:`take_password_from_env`, before it starts any process), so no worker, fork server
or user script inherits it; the rendezvous options then read it from memory. Import-light
on purpose: the agent calls this before it imports torch.
"""

from __future__ import annotations

import os

from elastic import env

_env_password: str | None = None


def take_password_from_env() -> None:
    """Move ``$ELASTIC_ETCD_PASSWORD`` out of the environment into this process's memory."""
    global _env_password
    value = os.environ.pop(env.ETCD_PASSWORD, None)
    if value:
        _env_password = value


def password_from_env() -> str | None:
    """The password taken by :func:`take_password_from_env` (or still in the environment)."""
    return _env_password or os.environ.get(env.ETCD_PASSWORD) or None


__all__ = ["password_from_env", "take_password_from_env"]
