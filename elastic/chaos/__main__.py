"""``python -m elastic.chaos``: the ``elastic chaos`` command."""

from elastic.chaos.command import main

raise SystemExit(main())
