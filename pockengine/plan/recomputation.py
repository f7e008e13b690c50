"""What a memory budget made a step recompute (``passes.remat_budget``), and what it
bought: the figures ``step.report()`` prints and the step artifact stores."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Recomputation", "Segment"]

_MIB = 1 << 20


@dataclass(frozen=True)
class Segment:
    """Nodes recomputed together, just before the backward node that needs them first."""

    layer: str  # the longest module path the recomputed nodes' sources share
    values: tuple[str, ...]  # the forward values recomputed
    ops: tuple[str, ...]
    flops: int


@dataclass(frozen=True)
class Recomputation:
    """What the budget made the step recompute, and what it bought."""

    budget: int
    peak_before: int  # planned peak of the same step without the budget
    peak_after: int
    step_flops: int  # all FLOPs of the step, the recomputation's included
    segments: tuple[Segment, ...]

    @property
    def extra_flops(self) -> int:
        return sum(s.flops for s in self.segments)

    @property
    def met(self) -> bool:
        return self.peak_after <= self.budget

    def lines(self) -> list[str]:
        share = self.extra_flops / self.step_flops if self.step_flops else 0.0
        verdict = (
            "met" if self.met else f"NOT met, {(self.peak_after - self.budget) / _MIB:.2f} MiB over"
        )
        lines = [
            f"recomputation for a memory budget of {self.budget / _MIB:.2f} MiB ({verdict}): "
            f"planned peak {self.peak_before / _MIB:.2f} -> {self.peak_after / _MIB:.2f} MiB",
            f"  {sum(len(s.values) for s in self.segments)} values in {len(self.segments)} "
            f"segments, {self.extra_flops / 1e9:.3f} GFLOP extra ({share:.1%} of the step)",
        ]
        for s in self.segments:
            lines.append(
                f"    {s.layer:<40} {len(s.ops):>3} ops {s.flops / 1e6:>10.1f} MFLOP  "
                + ", ".join(_counted(s.ops))
            )
        return lines

    def to_dict(self) -> dict[str, object]:
        return {
            "budget_bytes": self.budget, "met": self.met, "extra_flops": self.extra_flops,
            "peak_before_bytes": self.peak_before, "peak_after_bytes": self.peak_after,
            "step_flops": self.step_flops,
            "segments": [{"layer": s.layer, "values": list(s.values), "ops": list(s.ops),
                          "flops": s.flops} for s in self.segments],
        }  # fmt: skip


def _counted(ops: Sequence[str]) -> list[str]:
    counts: dict[str, int] = {}
    for op in ops:
        counts[op] = counts.get(op, 0) + 1
    return [f"{op} x{n}" if n > 1 else op for op, n in counts.items()]
