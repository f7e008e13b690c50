"""What a run writes into its folder and how it is read back: ``home`` and ``home_load``
(``RUN/model``, ``pe.load_run``), ``checkpoint``, ``best``, ``metrics_log``, ``adapter``
(PEFT files), ``released`` (the model's float copies released, the step the source of
every value written), ``run_files`` and ``run_meta`` (the checked readers of a run's
files)."""
