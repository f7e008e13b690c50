"""Error classes of the engine. Messages name the op, the node and where it came from."""

from __future__ import annotations

__all__ = [
    "CompileError",
    "GraphVerifyError",
    "ParseError",
    "PockEngineError",
    "SchemeError",
    "ShapeError",
    "UnsupportedOpError",
]


class PockEngineError(Exception):
    """Base of every error the engine raises on purpose."""


class CompileError(PockEngineError):
    """A model, loss or batch that cannot be compiled as given."""


class UnsupportedOpError(CompileError):
    """One or more ops that a frontend or backend cannot handle, listed all at once."""

    def __init__(self, what: str, entries: list[tuple[str, str]], hint: str = ""):
        self.entries = entries
        lines = [f"  {op}  at {where or '<unknown>'}" for op, where in entries]
        lines += [hint] if hint else []
        super().__init__(f"{len(entries)} unsupported {what}:\n" + "\n".join(lines))


class ShapeError(CompileError):
    """An op applied to inputs whose shapes or dtypes its rule rejects."""


class GraphVerifyError(PockEngineError):
    """A graph that breaks an IR invariant (SSA, order, types, effects)."""


class ParseError(PockEngineError):
    """Graph text that does not parse."""


class SchemeError(CompileError):
    """An update scheme that does not fit the model."""
