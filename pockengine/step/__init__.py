"""The step lifecycle: compiling a training step, running it, saving and loading it.

- ``compiler``: ``compile()``, the driver (frontend -> scheme -> autodiff -> optimizer ->
  passes -> backend), and ``TrainStep``, the step with the compiler's facts;
- ``parts``: what the compiler makes before a backend binds it (``StepParts``);
- ``running``: ``CompiledStep``, the bound step that trains (its state, ``__call__``,
  ``state_dict``, ``export``);
- ``artifact`` and ``artifact_json``: the step artifact (``save_step``, ``load_step``);
- ``child`` and ``child_relay``: compiling in a forked child, which returns the parts;
- ``evaluator``: evaluation through the compiled forward, on a step's own state;
- ``module_tensors``: training a torch module's own tensors (``in_place=True``);
- ``strict_load``: strict loading of state into a step or a torch module;
"""
