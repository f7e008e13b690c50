"""The torch kernel of ``elementwise_chain`` (``ops/ew_chain.py``): each step as its own
ATen call, in order. Only the C backend makes these nodes (``backends/c/fuse_ew.py``);
this kernel lets a graph holding one (an op-table test, a rewritten graph) run on torch."""

from __future__ import annotations

from pockengine.backends.torch.codegen import Emit, Emitter

__all__ = ["KERNELS"]


def _chain(e: Emit) -> list[str]:
    """The last step writes with ``out=`` where the plan lets the result overwrite an input."""
    ops, args = e.attr("ops"), e.attr("args")
    names = [*e.ins, *(e.tmp() for _ in ops[:-1]), e.out]
    calls = [[names[j] for j in js] for js in args]
    if e.into is not None:
        calls[-1].append(f"out={e.into}")
    return [
        f"{names[len(e.ins) + k]} = aten_{op}({', '.join(call)})"
        for k, (op, call) in enumerate(zip(ops, calls, strict=True))
    ]


KERNELS: dict[str, Emitter] = {"elementwise_chain": _chain}
