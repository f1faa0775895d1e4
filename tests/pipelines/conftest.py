"""remat inside the training pipelines people run (docs/pipelines.md): mixed precision
and gradient accumulation, the Hugging Face Trainer, options from ``remat.configure``
and ``REMAT_*`` variables, DDP and FSDP2 on two spawned ranks (``test_distributed.py``;
``ranks.py`` is what each rank runs), and the scripts in ``examples/``, each run small.
A new pipeline, or a new script in ``examples/``, gets its test here."""
