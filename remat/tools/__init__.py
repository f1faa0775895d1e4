"""Tools built on remat's library: the ``remat`` command line, the benchmark harness and
the example models it loads by name.

The core (``remat``, ``remat.passes``, ``remat.solvers``) never imports from here
(``tests/test_layout.py`` checks it), so the library stays usable without them.
"""
