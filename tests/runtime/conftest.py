"""Run time (``remat.runtime``): the step runner that records a step's runs, the memory
outside them and the gradients they hand back, plans the step as one (graph breaks, a
loss outside the model, a graph run more than once, DDP's buckets and FSDP2's blocks in
one process) and swaps its programs in; and the measurement it is held to
(``remat.memory``: ``peak`` and ``step_time``, checked against allocations of known
size). A test of what happens from the second step on, or of how a step is measured,
goes here."""
