"""The JAX frontend: ``jax.make_jaxpr(loss_fn)(params, *batch)`` -> IR.

``importer`` drives the tracing and the translation; ``info`` reads the params pytree's
``ModelInfo``; ``check`` lists unsupported primitives and what folds; ``flax`` lowers
Flax's ``BatchNorm`` whole; ``converters`` holds the flat table keyed by JAX primitive,
which ``math``, ``nn`` and ``shape`` fill.
"""

from __future__ import annotations

from pockengine.frontend.jax.importer import import_jax, jax_model_info

__all__ = ["import_jax", "jax_model_info"]
