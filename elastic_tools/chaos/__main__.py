"""``python -m elastic_tools.chaos``: the ``elastic chaos`` command."""

from elastic_tools.chaos.command import main

raise SystemExit(main())
