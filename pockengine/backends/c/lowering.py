"""The rewrites the C backend runs on a step's graph before it plans and emits it: products
and the loss head on low-bit frozen matrices read the codes (``fuse_lowbit.py``); batch
norm and the hardtanh after it run as one kernel each way (``fuse_bn.py``); a depthwise
convolution reads such a batch norm's input, not its output (``fuse_dw_bn.py``); a
transposed matrix product (a weight's gradient) is the product of its transposed operands,
read strided (``fuse_transpose.py``); chains of elementwise nodes run as one loop each
(``fuse_ew.py``). The same list
serves ``CBackend.lowering_passes`` (``pe.compile`` runs it before a memory budget plans),
``CExecutable`` and the exported trainer, so all three plan the graph C runs."""

from __future__ import annotations

from collections.abc import Callable

from pockengine.backends.c.fuse_bn import fuse_batch_norm_hardtanh
from pockengine.backends.c.fuse_dw_bn import fuse_depthwise_batch_norm
from pockengine.backends.c.fuse_ew import fuse_elementwise_chains
from pockengine.backends.c.fuse_lowbit import fuse_lowbit_products
from pockengine.backends.c.fuse_transpose import transpose_products
from pockengine.ir import Graph

__all__ = ["LOWERING_PASSES", "lower_for_c"]

LOWERING_PASSES: tuple[Callable[[Graph], Graph], ...] = (
    fuse_lowbit_products,
    fuse_batch_norm_hardtanh,
    fuse_depthwise_batch_norm,
    transpose_products,
    fuse_elementwise_chains,
)


def lower_for_c(graph: Graph) -> Graph:
    """``graph`` after every pass of ``LOWERING_PASSES``, in order."""
    for rewrite in LOWERING_PASSES:
        graph = rewrite(graph)
    return graph
