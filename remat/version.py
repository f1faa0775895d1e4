"""remat's version: one place, read by the package, the plan cache's keys and ``--version``."""

__version__ = "0.1.0"
