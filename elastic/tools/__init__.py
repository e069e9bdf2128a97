"""The ``elastic`` command: ``status`` and ``demo``, and the local-cluster driver behind them."""

__all__: list[str] = []
