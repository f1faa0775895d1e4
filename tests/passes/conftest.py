"""The fx passes (``remat.passes``), each on graphs small enough to read: identity clones
dropped (``clones.py``), slice gradients added into their sums (``slice_grads.py``),
dropout made replayable (``rng.py``), views that a run-time
layout cannot serve (``rewrite.py``), sizes read at a binding of a graph's symbols
(``sizes.py``). A test of a pass goes in ``test_<pass>.py``, with the end-to-end check
of what that pass promises beside it where one is needed."""
