"""The ``elastic`` command: the users' commands (the harness is :mod:`elastic_tools.harness`)."""

__all__: list[str] = []
