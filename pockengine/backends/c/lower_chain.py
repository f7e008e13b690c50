"""C lowering of ``elementwise_chain`` (``ops/ew_chain.py``): one loop nest over the
result, each step a local of the element type, the inputs broadcast by their strides.

Each step is the expression ``lower_ew`` writes for its op alone (the same operators and
``kernels/elementwise.h`` functions), stored in a local of the same type, so the chain
rounds exactly as the separate loops did (the trainer compiles with ``-std=c11``: no
contraction into fused multiply-adds).
"""

from __future__ import annotations

from pockengine.backends.c.emit import CTYPES, EmitContext, Lowering, strides
from pockengine.backends.c.emit import kernel_suffix as _sfx
from pockengine.backends.c.lower_ew import broadcast_strides
from pockengine.ir import Node

__all__ = ["KERNELS"]

# op -> its C expression ({0}, {1}: operands; {s}: the kernel suffix, f32 or f64)
_EXPRESSIONS = {
    "add": "{0} + {1}",
    "sub": "{0} - {1}",
    "mul": "{0} * {1}",
    "div": "{0} / {1}",
    "neg": "-{0}",
    "sigmoid": "pe_sigmoid_{s}({0})",
    "rsqrt": "pe_rsqrt_{s}({0})",
    "exp": "exp({0})",
    "tanh": "tanh({0})",
    "reciprocal": "1 / {0}",
}


def _chain(ctx: EmitContext, node: Node) -> str:
    out = node.outputs[0]
    ctype, sfx = CTYPES[out.dtype], _sfx(out)
    ops, args = node.attrs["ops"], node.attrs["args"]
    assert isinstance(ops, tuple) and isinstance(args, tuple)
    operands = [(ctx.ref(out), strides(out.shape))]
    operands += [(ctx.ref(v), broadcast_strides(v, out.shape)) for v in node.inputs]

    def body(refs: list[str]) -> str:
        names = refs[1:] + [f"t{k}" for k in range(len(ops))]
        steps = [
            f"const {ctype} t{k} = {_EXPRESSIONS[str(op)].format(*(names[j] for j in js), s=sfx)};"
            for k, (op, js) in enumerate(zip(ops, args, strict=True))
        ]
        return "{ " + " ".join(steps) + f" {refs[0]} = t{len(ops) - 1}; }}"

    return ctx.loops(out.shape, operands, body)


KERNELS: dict[str, Lowering] = {"elementwise_chain": _chain}
