"""Compiling a run's step (``task_step``), here or in a child process: ``compile_child``
(the child), ``child`` (the helper-process protocol), ``child_folder`` (its files),
``compiled_task`` and ``model_skeleton`` (what it hands the process that trains)."""
