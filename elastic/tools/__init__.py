"""The ``elastic`` command: the users' commands (the harness is :mod:`elastic.harness`)."""

__all__: list[str] = []
