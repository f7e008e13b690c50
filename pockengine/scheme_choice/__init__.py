"""Choosing what trains: the contribution analysis of ``pockengine search``
(``sensitivity``, ``scheme_search``), the knapsack over its items (``search``), the
estimates ``--scheme auto`` chooses from (``estimate``, ``gradient_sums``, ``auto_scheme``)
and the learning-rate choice (``lr_choice``). It compiles steps (``pockengine.step``) for
the tasks of ``pockengine.tasks``; the fine-tuning run and federated runs call it."""
