"""``remat.tools``: the ``remat`` command line (``test_cli.py``: tables, errors, exit
codes, help), the benchmark harness and the ``bench`` / ``pareto`` commands
(``test_bench.py``), and the built-in example models every tool relies on
(``test_examples.py``; the scripts in ``examples/`` are run in ``tests/pipelines/``).
A test of a command, a table or an example model goes here."""
