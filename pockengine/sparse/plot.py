"""A picture of a contribution analysis: what each candidate is worth against its cost.

``plot_contributions(rows, chosen, path)`` draws (left) each candidate's accuracy gain
against the extra planned-peak memory it costs over its baseline, and (right) the gains
layer by layer, biases and each weight ratio with their own marker; the chosen
candidates are ringed. Needs matplotlib (a dependency of pockengine).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pockengine.ir import PockEngineError
from pockengine.safe_write import write_with

__all__ = ["plot_contributions"]

_MIB = 1 << 20


def plot_contributions(
    rows: Sequence[Mapping[str, Any]],
    chosen: Sequence[str],
    path: str | Path,
    title: str = "",
) -> Path:
    """Write the PNG; ``rows`` are ``Analysis.rows()`` (key, kind, layer, ratio,
    contribution, extra costs), ``chosen`` the chosen keys."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PockEngineError("the plot needs matplotlib: pip install 'matplotlib>=3.8'") from exc
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    styles = _styles(rows)
    fig, (cost_ax, layer_ax) = plt.subplots(1, 2, figsize=(14, 5.5))
    for label, (marker, colour) in styles.items():
        mine = [r for r in rows if _label(r) == label]
        xs = [r["extra"]["planned_peak_bytes"] / _MIB for r in mine]
        ys = [100 * r["contribution"] for r in mine]
        cost_ax.scatter(xs, ys, marker=marker, color=colour, label=label, s=22, alpha=0.8)
        layer_ax.scatter(
            [layers.index(r["layer"]) for r in mine],
            ys,
            marker=marker,
            color=colour,
            s=22,
            alpha=0.8,
        )
    picked = [r for r in rows if r["key"] in set(chosen)]
    ring = {"s": 110, "facecolors": "none", "edgecolors": "black", "linewidths": 1.4}
    cost_ax.scatter(
        [r["extra"]["planned_peak_bytes"] / _MIB for r in picked],
        [100 * r["contribution"] for r in picked],
        label="chosen",
        **ring,
    )
    layer_ax.scatter(
        [layers.index(r["layer"]) for r in picked],
        [100 * r["contribution"] for r in picked],
        **ring,
    )
    cost_ax.set_xlabel("extra planned peak over its baseline (MiB)")
    layer_ax.set_xlabel("layer (module order)")
    step = max(1, len(layers) // 24)
    layer_ax.set_xticks(range(0, len(layers), step))
    layer_ax.set_xticklabels([_short(n) for n in layers[::step]], rotation=75, fontsize=6)
    for ax in (cost_ax, layer_ax):
        ax.axhline(0, color="grey", linewidth=0.6)
        ax.set_ylabel("validation accuracy gain (points)")
        ax.grid(alpha=0.3)
    cost_ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    try:
        write_with(out, lambda f: fig.savefig(f, format=out.suffix[1:] or "png", dpi=110))
    finally:
        plt.close(fig)
    return out


def _label(row: Mapping[str, Any]) -> str:
    return "bias" if row["kind"] == "bias" else f"weight r={row['ratio']:g}"


def _styles(rows: Sequence[Mapping[str, Any]]) -> dict[str, tuple[str, str]]:
    labels = sorted({_label(r) for r in rows}, key=lambda s: (s != "bias", s))
    colours = ["tab:green", "tab:blue", "tab:orange", "tab:red", "tab:purple", "tab:brown"]
    markers = ["s", "o", "^", "D", "v", "P"]
    return {
        label: (markers[i % len(markers)], colours[i % len(colours)])
        for i, label in enumerate(labels)
    }


def _short(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[-3:]) if len(parts) > 3 else name
