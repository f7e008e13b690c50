"""Graph -> text, one node per line; ``ir.parser`` reads the same text back."""

from __future__ import annotations

from pockengine.ir.types import Graph, Node, Phase, Role, Value

__all__ = ["print_graph", "print_node"]


def _input_decl(v: Value) -> str:
    role = str(v.role)
    if v.role is Role.PARAM and not v.trainable:
        role = "param(frozen)"
    return f"{v.name}: {v.type} {role}"


def print_node(node: Node) -> str:
    args = [str(v) for v in node.inputs]
    args += [f"{k}={v!r}" for k, v in node.attrs.items()]
    call = f"{node.op}({', '.join(args)})"
    if node.outputs:
        lhs = ", ".join(f"%{v.name}: {v.type}" for v in node.outputs)
        line = f"{lhs} = {call}"
    else:
        line = f"! {call}"
    if node.phase is not Phase.FORWARD:  # forward is the default and is not written
        line = f"{line} @{node.phase}"
    return f"{line}  # {node.source}" if node.source else line


def print_graph(graph: Graph) -> str:
    lines = [f"graph {graph.name}("]
    lines += [f"    {_input_decl(v)}," for v in graph.inputs]
    lines.append(") {")
    lines += [f"  {print_node(n)}" for n in graph.nodes]
    lines.append(f"  return {', '.join(str(v) for v in graph.outputs)}")
    lines.append("}")
    return "\n".join(lines)
