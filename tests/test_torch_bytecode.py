"""The torch backend parses a large generated step in a forked child
(``backends.torch.bytecode``).

- a source of at least ``FORK_MIN_CHARS`` comes back from the child as the code object
  ``compile()`` makes here, field for field, without this process parsing it;
- a smaller source, a platform or process where forking is not safe, a failed fork and
  a failed child all parse here (a syntax error is raised as ``compile()`` raises it);
- a compiled step whose source is parsed in the child trains bit for bit as one parsed
  here, and a kernel's error still names its node.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from typing import Any

import numpy as np
import pytest

import pockengine as pe
from pockengine import zoo
from pockengine.backends.torch import bytecode
from pockengine.backends.torch.backend import TorchBackend, TorchKernelError
from pockengine.ir import DType, GraphBuilder, TensorType


def _source(lines: int) -> str:
    body = "".join(f"    v{k + 1} = v{k} * {k} + 1.5  # node {k}\n" for k in range(lines))
    return f"def f(v0):\n{body}    return v{lines}\n"


def _fields(code: types.CodeType) -> tuple[Any, ...]:
    return (code.co_code, code.co_consts, code.co_names, code.co_varnames, code.co_filename,
            code.co_firstlineno, code.co_linetable)  # fmt: skip


@pytest.fixture
def parsed_here(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The file names of the sources this process parses itself. Forking counts as safe
    (another test in this process may have started JAX or imported TensorFlow, which turns
    it off: ``test_a_fresh_torch_process_may_fork`` checks the real condition)."""
    monkeypatch.setattr(bytecode, "_can_fork", lambda: True)
    calls: list[str] = []
    real = bytecode._parse_here

    def record(source: str, filename: str) -> types.CodeType:
        calls.append(filename)
        return real(source, filename)

    monkeypatch.setattr(bytecode, "_parse_here", record)
    return calls


def test_a_large_source_is_parsed_in_the_child(parsed_here: list[str]) -> None:
    source = _source(1200)
    assert len(source) >= bytecode.FORK_MIN_CHARS
    code = bytecode.code_object(source, "<big>")
    assert parsed_here == []
    outer = compile(source, "<big>", "exec")
    assert _fields(code) == _fields(outer)
    inner = [c for c in code.co_consts if isinstance(c, types.CodeType)]
    expected = [c for c in outer.co_consts if isinstance(c, types.CodeType)]
    assert [_fields(c) for c in inner] == [_fields(c) for c in expected]
    namespace: dict[str, Any] = {}
    exec(code, namespace)
    assert namespace["f"](2.0) == pytest.approx(_run_here(source, 2.0))


def _run_here(source: str, x: float) -> float:
    namespace: dict[str, Any] = {}
    exec(compile(source, "<here>", "exec"), namespace)
    return float(namespace["f"](x))


def test_a_small_source_is_parsed_here(parsed_here: list[str]) -> None:
    bytecode.code_object(_source(3), "<small>")
    assert parsed_here == ["<small>"]


@pytest.mark.parametrize("case", ["unsafe", "fork fails", "child fails"])
def test_falls_back_to_parsing_here(
    case: str, parsed_here: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _source(1200)
    if case == "unsafe":
        monkeypatch.setattr(bytecode, "_can_fork", lambda: False)
    elif case == "fork fails":

        def no_fork() -> int:
            raise OSError("no fork here")

        monkeypatch.setattr(os, "fork", no_fork)
    else:
        monkeypatch.setattr(bytecode.marshal, "dumps", lambda code: 1 / 0)
    code = bytecode.code_object(source, "<fallback>")
    assert parsed_here == ["<fallback>"]
    assert _fields(code) == _fields(compile(source, "<fallback>", "exec"))


def test_a_syntax_error_is_raised_as_compile_raises_it(parsed_here: list[str]) -> None:
    source = _source(1200) + "    return (\n"
    with pytest.raises(SyntaxError):
        bytecode.code_object(source, "<broken>")
    assert parsed_here == ["<broken>"]  # the child failed; parsed here to raise the error


def test_a_fresh_torch_process_may_fork() -> None:
    code = (
        "import torch; from pockengine.backends.torch import bytecode; print(bytecode._can_fork())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=300)  # fmt: skip
    assert done.stdout.strip() == "True", done.stderr


def test_not_forked_beside_a_started_jax_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    bridge = types.SimpleNamespace(backends_are_initialized=lambda: True)
    monkeypatch.setitem(sys.modules, "jax._src.xla_bridge", bridge)
    assert not bytecode._can_fork()


def _train(work: zoo.Workload, steps: int = 3) -> tuple[list[float], dict[str, np.ndarray]]:
    batch = work.make_batch(0)
    step = pe.compile(work.model, work.loss_fn, batch, pe.optim.AdamW(lr=1e-3),
                      backend=TorchBackend(), compile_in="process")  # fmt: skip
    losses = [float(step(*batch)) for _ in range(steps)]
    return losses, {k: np.array(v) for k, v in step.state_dict().items()}


def test_a_step_parsed_in_the_child_trains_as_one_parsed_here(
    parsed_here: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    here = _train(zoo.mlp())
    assert any(name.startswith("<pockengine-torch") for name in parsed_here)
    monkeypatch.setattr(bytecode, "FORK_MIN_CHARS", 0)
    parsed_here.clear()
    child = _train(zoo.mlp())
    assert not any(name.startswith("<pockengine-torch") for name in parsed_here)
    assert child[0] == here[0]
    assert here[1].keys() == child[1].keys()
    for name, value in here[1].items():
        np.testing.assert_array_equal(child[1][name], value, err_msg=name)


def test_a_kernel_error_names_its_node_when_parsed_in_the_child(
    parsed_here: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bytecode, "FORK_MIN_CHARS", 0)
    b = GraphBuilder("g")
    x = b.input("x", TensorType((2, 3), DType.F64))
    i = b.input("i", TensorType((2, 1), DType.I64))
    graph = b.build([b.call("gather", x, i, axis=1, source="my.module")])
    backend = TorchBackend()
    feeds = {"x": backend.from_numpy(np.ones((2, 3))), "i": backend.from_numpy(np.full((2, 1), 5))}
    executable = backend.compile(graph)
    assert parsed_here == []
    with pytest.raises(TorchKernelError, match=r"gather\(x, i, axis=1\)  # my.module"):
        executable.run({}, feeds)
