"""The Keras frontend: a Keras model traced in a ``tf.function`` with a named loss -> IR.

``importer`` drives the translation; ``trace`` traces the model, each TF op knowing its
layer; ``layers`` lowers BatchNormalization, LayerNormalization and Dropout whole from the
layer; ``converters`` holds the flat table keyed by TF op type, which ``image``, ``math``,
``nn`` and ``shape`` fill.
"""

from __future__ import annotations

from pockengine.frontend.keras.importer import (
    check_supported,
    import_keras,
    keras_model_info,
    require_tensorflow,
)

__all__ = ["check_supported", "import_keras", "keras_model_info", "require_tensorflow"]
