"""What a scheme resolves to: the trained params, and the LoRA adapters the compile inserts.

``Scheme.resolve`` (``schemes``) gives a ``Resolution``; ``lora.resolve_lora`` fills its
``adapters``, which ``lora.insert_adapters`` adds to the imported forward graph.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Adapter", "Resolution"]


@dataclass(frozen=True)
class Adapter:
    """One LoRA adapter: the frozen weight it adapts and the shapes of its two factors."""

    module: str  # the owning module's path
    weight: str  # the frozen weight's name (model name and IR name)
    in_features: int
    out_features: int
    rank: int
    alpha: float
    seed: int = 0  # A's initial values: seeded by (seed, the adapter's index)
    kernel: bool = False  # W is stored [in, out] (JAX/Keras kernels), not torch's [out, in]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def a_name(self) -> str:
        return f"{self.module}.lora_A.weight" if self.module else "lora_A.weight"

    @property
    def b_name(self) -> str:
        return f"{self.module}.lora_B.weight" if self.module else "lora_B.weight"


@dataclass(frozen=True)
class Resolution:
    """The trained params: name -> trained leading rows (None: all of it)."""

    rows: dict[str, int | None]
    frozen_bn_eval: bool = False
    adapters: tuple[Adapter, ...] = ()  # LoRA adapters the compile inserts (their factors train)
    running_bn: bool = False  # every BatchNorm on its running statistics, trained ones too

    @property
    def names(self) -> set[str]:
        return set(self.rows)
