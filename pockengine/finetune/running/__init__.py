"""Running a fine-tune: ``launch`` (checks, lock, the compile child), ``trainer`` (the
run's orchestration), ``loop`` (the training loop), ``progress``, ``curves``, ``result``
and ``run_lock``."""
