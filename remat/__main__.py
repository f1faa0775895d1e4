"""``python -m remat``: the ``remat`` command line."""

from remat.cli import main

raise SystemExit(main())
