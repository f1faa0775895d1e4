"""``python -m remat``: the ``remat`` command line."""

from remat.tools.cli import main

raise SystemExit(main())
