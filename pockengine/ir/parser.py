"""Text -> Graph: the inverse of ``print_graph`` (types are re-checked by the shape rules)."""

from __future__ import annotations

import ast
import re

from pockengine.ir.errors import ParseError
from pockengine.ir.registry import get_op
from pockengine.ir.types import Attrs, DType, Graph, Node, Phase, Role, TensorType, Value

__all__ = ["parse_graph"]

_HEADER = re.compile(r"graph\s+([\w.]+)\s*\((.*?)\)\s*\{", re.S)
_DECL = re.compile(r"(\w[\w.]*)\s*:\s*(\w+)\[([\d,\s]*)\]\s+(\w+)(\(frozen\))?")
_RESULT = re.compile(r"%(\w[\w.]*)\s*:\s*(\w+)\[([\d,\s]*)\]")
_CALL = re.compile(r"([\w.]+)\((.*)\)$", re.S)
_PHASE = re.compile(r"\s@(backward|update)$")  # the printer's mark of a non-forward node


def _type(dtype: str, dims: str) -> TensorType:
    shape = tuple(int(d) for d in dims.replace(" ", "").split(",") if d)
    return TensorType(shape, DType(dtype))


_NON_FINITE = {"inf": float("inf"), "nan": float("nan")}  # how repr() writes them


def _literal(node: ast.expr) -> object:
    """A Python literal, as ``ast.literal_eval`` reads it, plus the ``inf`` and ``nan``
    that ``repr`` writes for non-finite floats (``full(value=-inf)``, a mask's fill)."""
    if isinstance(node, ast.Name) and node.id in _NON_FINITE:
        return _NON_FINITE[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ValueError(f"a sign before {value!r}")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Tuple | ast.List):
        items = [_literal(e) for e in node.elts]
        return tuple(items) if isinstance(node, ast.Tuple) else items
    if isinstance(node, ast.Dict):
        return {
            _literal(k): _literal(v)
            for k, v in zip(node.keys, node.values, strict=True)
            if k is not None
        }
    return ast.literal_eval(node)


def _attr(text: str, lineno: int) -> object:
    try:
        return _literal(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError) as exc:
        raise ParseError(f"line {lineno}: attribute value {text!r} is not a literal") from exc


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets or quotes."""
    parts: list[str] = []
    cur: list[str] = []
    depth, quote = 0, ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    tail = "".join(cur).strip()
    if tail:
        parts.append(tail)
    return parts


def _parse_node(line: str, env: dict[str, Value], lineno: int) -> Node:
    source = ""
    if "  # " in line:
        line, source = line.rsplit("  # ", 1)
        line, source = line.strip(), source.strip()
    phase = Phase.FORWARD
    marked = _PHASE.search(line)
    if marked:
        line, phase = line[: marked.start()].rstrip(), Phase(marked.group(1))
    outs: list[Value] = []
    if line.startswith("!"):
        call = line[1:].strip()
    else:
        lhs, _, call = line.partition(" = ")
        for m in _RESULT.finditer(lhs):
            outs.append(Value(m.group(1), _type(m.group(2), m.group(3))))
        if not outs:
            raise ParseError(f"line {lineno}: expected results before ' = ': {line!r}")
    called = _CALL.match(call.strip())
    if not called:
        raise ParseError(f"line {lineno}: expected op(args): {call!r}")
    op, arglist = called.group(1), called.group(2)
    get_op(op)  # an unknown op is an error here, not later
    inputs: list[Value] = []
    attrs: dict[str, object] = {}
    for arg in _split_top(arglist):
        key, eq, rest = arg.partition("=")
        if eq and re.fullmatch(r"\w+", key.strip()):
            attrs[key.strip()] = _attr(rest.strip(), lineno)
            continue
        name = arg.lstrip("%")
        if name not in env:
            raise ParseError(f"line {lineno}: {op} reads undefined value {arg!r}")
        inputs.append(env[name])
    node = Node(op, tuple(inputs), tuple(outs), Attrs(attrs), source, phase)  # type: ignore[arg-type]
    for v in outs:
        env[v.name] = v
    return node


def parse_graph(text: str) -> Graph:
    """Parse the printer's text format back into a Graph."""
    header = _HEADER.search(text)
    if not header:
        raise ParseError("expected 'graph NAME(...) {'")
    env: dict[str, Value] = {}
    inputs: list[Value] = []
    for decl in _split_top(header.group(2)):
        m = _DECL.fullmatch(decl.strip())
        if not m:
            raise ParseError(f"bad input declaration {decl!r}")
        role = Role(m.group(4))
        trainable = role is Role.PARAM and not m.group(5)
        v = Value(m.group(1), _type(m.group(2), m.group(3)), role, trainable)
        inputs.append(v)
        env[v.name] = v
    nodes: list[Node] = []
    outputs: tuple[Value, ...] = ()
    body = text[header.end() :]
    for lineno, raw in enumerate(body.splitlines(), start=text[: header.end()].count("\n") + 1):
        line = raw.strip()
        if not line or line == "}":
            continue
        if line.startswith("return"):
            names = [n.strip().lstrip("%") for n in line[len("return") :].split(",") if n.strip()]
            missing = [n for n in names if n not in env]
            if missing:
                raise ParseError(f"line {lineno}: return of undefined {missing}")
            outputs = tuple(env[n] for n in names)
            continue
        nodes.append(_parse_node(line, env, lineno))
    return Graph(header.group(1), tuple(inputs), tuple(nodes), outputs)
