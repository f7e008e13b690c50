"""The torch frontend: ``torch.export`` -> core ATen -> IR.

``importer`` drives the export and the translation; ``converters`` holds the flat table
keyed by ATen overload name and the ``Ctx`` converters use; ``attention``, ``image``,
``layout``, ``math``, ``nn``, ``reduce``, ``select`` and ``shape`` fill the table.
"""

from __future__ import annotations

from pockengine.frontend.torch.importer import import_torch, module_path, torch_model_info

__all__ = ["import_torch", "module_path", "torch_model_info"]
