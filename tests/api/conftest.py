"""remat as a user calls it: ``optimize``, ``plan`` and ``backend`` on whole models,
trained beside eager (eager's losses, gradients, buffers and RNG state; a measured peak
within the budget and equal to the prediction), the patterns and random models users
bring (``test_fuzz.py`` draws them with ``fuzz.py``), the reversible layers of
``remat.nn``, and the plan cache a call reads and writes (``remat.cache``, ``remat.keys``).
A test that runs the whole pass through the public API, or checks an option of it, goes
here; one that needs a training pipeline around it (mixed precision, a Trainer, several
ranks) goes to ``tests/pipelines/``."""
