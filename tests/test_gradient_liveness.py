"""Each trained weight's gradient dies at its update, inside the backward pass.

The smollm2-pydocs recipe trains ``o_proj`` and ``down_proj`` of every block (plus the
norms): 139 MiB of gradients if all were alive at once. ``reorder_updates`` places each
update right after its gradient is complete, so the plan holds about one block's at a
time; ``step.report()`` shows both figures (``gradients`` and ``alive at once``).
"""

from __future__ import annotations

import pockengine as pe
from pockengine import zoo
from pockengine.passes import DEFAULT_PIPELINE, Pass
from pockengine.passes.reorder import reorder_updates
from pockengine.plan.report import analyze

TRAIN = ("*norm*", "*.mlp.down_proj.weight", "*.self_attn.o_proj.weight")


def _step(passes: tuple[Pass, ...] = DEFAULT_PIPELINE) -> pe.TrainStep:
    w = zoo.llama_lm(layers=3, hidden=64, ffn=256, seq=8)
    return pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=pe.optim.AdamW(),
                      scheme=pe.schemes.select(TRAIN), passes=passes)  # fmt: skip


def test_gradients_die_at_their_updates_one_block_at_a_time() -> None:
    step = _step()
    figures = analyze(step.graph)
    grads = {n.inputs[0].name: n.inputs[1] for n in step.graph.nodes if n.op == "adamw_update"}
    largest = max(g.type.nbytes for g in grads.values())
    per_block = 4 * (64 * 256 + 64 * 64 + 2 * 64)  # down_proj, o_proj, two norms (f32)
    assert figures.gradient_bytes == sum(g.type.nbytes for g in grads.values())
    assert largest <= figures.gradient_live_bytes <= per_block
    assert figures.gradient_live_bytes < figures.gradient_bytes / 3
    assert step.report().ours.gradient_live_bytes == figures.gradient_live_bytes
    assert "alive at once" in str(step.report())


def test_without_reordering_every_gradient_is_alive_at_the_end() -> None:
    """What the figure would be if updates stayed after the backward pass."""
    step = _step(tuple(p for p in DEFAULT_PIPELINE if p is not reorder_updates))
    figures = analyze(step.graph)
    assert figures.gradient_live_bytes == figures.gradient_bytes
