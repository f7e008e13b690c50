"""``pe.compile(..., compile_in="child")``: compile in a forked child, keep only the step.

Compiling leaves memory in the process that compiled: ``torch.export``'s graph module and
FakeTensor metadata (held from C++, never collected), the IR and the pass stages, Python
objects and the malloc arenas they pin. A process
that trains keeps none of it when another process compiled. With ``compile_in="child"``
``compile_forked``:

1. forks (POSIX only). The child has the model and the ``loss_fn`` closure by fork, with
   nothing pickled; it sets one torch thread first (the parent's OpenMP pool does not
   survive a fork), runs the whole compile (trace, autodiff, passes) up to the
   ``StepParts`` a backend would bind, and writes them to a temporary folder in the step
   artifact's formats (``artifact``): ``step.ir`` (the training graph), ``forward.ir`` (the
   fused forward, for ``gradients`` and ``evaluator``), ``state.safetensors`` and
   ``step.json`` (``artifact_json.facts_json``). A value that *is* a tensor of the torch
   module (same memory, shape, strides, dtype) is not written: ``step.json`` names it and
   the parent binds its own module's tensor, as the frontend does in process. All-zero
   values (the optimizer state's zeros) are listed and the parent allocates them.
2. The child sends one JSON message through a pipe: the warnings and ``logging`` records
   it emitted, in order, and its error if it failed; then it leaves with ``os._exit``.
3. The parent waits (``TIMEOUT_S``, ``PE_COMPILE_TIMEOUT``), re-emits the warnings
   (same category) and log records, raises the child's error as the same engine error
   class with the same message (another exception: a ``CompileError`` naming its type),
   and reads the parts back; the driver (``pockengine.step.compiler``) binds them to the
   backend: a ``TrainStep`` that trains bit-identically to one compiled in process. Its
   pass stages are made again on first read (``TrainStep.stages``); ``forward_stages``
   holds the fused forward only.

Only the torch and ONNX frontends compile in a child: JAX and TensorFlow run thread pools
that a fork can deadlock (JAX warns on fork). ``compile_mode`` picks the mode: the
``compile_in`` argument, else ``PE_COMPILE_IN``, else ``DEFAULT_COMPILE_IN``. A JAX or
Keras model, or a platform without ``os.fork``, compiles in process when the mode came
from a default, and is an error for an explicit ``compile_in="child"``; a torch or ONNX
model forks by default only while no JAX runtime has started and TensorFlow is not loaded
(the child runs neither, but their threads make a fork a risk the caller should choose).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import select
import signal
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from pockengine.ir import CompileError, Graph, Role
from pockengine.ir.arrays import Array
from pockengine.passes import Pass
from pockengine.sparse.schemes import Scheme
from pockengine.step.artifact import (
    check_state,
    parse_graph_text,
    read_graph,
    read_graph_text,
    read_tensors,
    write_graph,
    write_values,
)
from pockengine.step.artifact_json import facts_json, read_facts
from pockengine.step.child_relay import Relay, capture, raise_error, replay
from pockengine.step.parts import StepParts

if TYPE_CHECKING:
    from pockengine.optim import Optimizer

__all__ = [
    "COMPILE_IN", "DEFAULT_COMPILE_IN", "TIMEOUT_S", "compile_forked", "compile_mode",
    "compile_timeout",
]  # fmt: skip

log = logging.getLogger(__name__)
COMPILE_IN = ("process", "child")
DEFAULT_COMPILE_IN = "child"
TIMEOUT_S = 3600.0  # a compile that takes longer is stopped (``PE_COMPILE_TIMEOUT``: seconds)
_FORKABLE = ("torch", "onnx")
GRAPH, FORWARD, STATE, META = "step.ir", "forward.ir", "state.safetensors", "step.json"
_FAILED = 70  # the child's exit status when it could not even report its error


def compile_mode(compile_in: str | None, kind: str) -> str:
    """Where a model of frontend ``kind`` compiles: "process" or "child" (module doc)."""
    source = "compile_in"
    asked = compile_in
    if asked is None:
        source, asked = "PE_COMPILE_IN", os.environ.get("PE_COMPILE_IN") or DEFAULT_COMPILE_IN
    if asked not in COMPILE_IN:
        raise CompileError(f"{source} must be one of {COMPILE_IN}, got {asked!r}")
    if asked == "process":
        return asked
    problem = _fork_problem(kind)
    if problem is not None:
        if compile_in == "child":
            raise CompileError(f"compile_in='child': {problem}; compile_in='process' compiles here")
        return "process"
    if compile_in is None and _threaded_runtime():
        return "process"  # asked for by default only: a fork beside those threads may hang
    return "child"


def _fork_problem(kind: str) -> str | None:
    """Why a compile of a ``kind`` model cannot fork, or None."""
    if not hasattr(os, "fork"):
        return "this platform has no os.fork"
    if kind not in _FORKABLE:
        return f"the {kind} frontend compiles in process only (its runtime's threads do not fork)"
    return None


def _threaded_runtime() -> bool:
    """Whether JAX's runtime or CUDA has started or TensorFlow is loaded here: their thread
    pools and contexts do not survive a fork (JAX warns on every fork; a forked child
    cannot use CUDA), so only an explicit request forks."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    started = bridge is not None and bool(bridge.backends_are_initialized())
    torch = sys.modules.get("torch")
    cuda = torch is not None and bool(torch.cuda.is_initialized())  # CUDA does not fork
    return started or cuda or "tensorflow" in sys.modules


def compile_forked(
    build: Callable[[], StepParts],
    module: Any | None,
    optimizer: Optimizer,
    scheme: Scheme | None,
    passes: Sequence[Pass],
) -> StepParts:
    """``build()`` run in a forked child, its parts read back here for the caller to bind.
    ``module``: the torch model, whose tensors the parts hold by name (None: every value is
    read from the child's file); ``optimizer``, ``scheme``, ``passes``: what ``build``
    uses."""
    with tempfile.TemporaryDirectory(prefix="pe-compile-") as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        relay = _run_forked(lambda: _write_parts(build(), folder, module))
        replay(relay)
        if relay.error is not None:
            raise_error(relay.error)
        read = time.perf_counter()
        parts = _read_parts(folder, module, optimizer, scheme, passes)
    log.debug(
        "compiled in a child in %.2f s, read back in %.2f s",
        read - start,
        time.perf_counter() - read,
    )
    return parts


# -- the child -----------------------------------------------------------------------------
def _write_parts(parts: StepParts, folder: Path, module: Any | None) -> None:
    """``parts`` as files in ``folder`` (module doc); values of ``module`` by name only."""
    from_module = _module_names(parts.values, module)
    rest = {name: np.asarray(v) for name, v in parts.values.items() if name not in from_module}
    zeros = write_values(folder / STATE, rest)
    assert isinstance(parts.forward, Graph), "built in this process: a parsed graph"
    meta = {
        "graph_sha256": write_graph(folder / GRAPH, parts.graph),
        "forward_sha256": write_graph(folder / FORWARD, parts.forward),
        **facts_json(parts.facts, parts.info, parts.resolution),
        "from_module": from_module,
        "zeros": {name: [rest[name].dtype.str, list(rest[name].shape)] for name in zeros},
    }
    (folder / META).write_text(json.dumps(meta), encoding="utf-8")


def _key(array: Array) -> tuple[int, tuple[int, ...], tuple[int, ...], str]:
    return array.__array_interface__["data"][0], array.shape, array.strides, array.dtype.str


def _module_names(values: dict[str, Any], module: Any | None) -> dict[str, str]:
    """IR name -> the module's own name, for each value that is a tensor of ``module``."""
    if module is None:
        return {}
    tensors: dict[tuple[int, tuple[int, ...], tuple[int, ...], str], str] = {}
    named = (*module.named_parameters(remove_duplicate=False),
             *module.named_buffers(remove_duplicate=False))  # fmt: skip
    for name, tensor in named:
        if tensor.device.type != "cpu" or not tensor.numel():
            continue
        with contextlib.suppress(TypeError, RuntimeError):  # no NumPy dtype (bfloat16)
            tensors.setdefault(_key(tensor.detach().numpy()), name)
    out = {}
    for ir, value in values.items():
        if isinstance(value, np.ndarray) and value.size and _key(value) in tensors:
            out[ir] = tensors[_key(value)]
    return out


def _run_forked(work: Callable[[], None]) -> Relay:
    """``work()`` in a forked child; what it reported (warnings, logs, its error)."""
    timeout = compile_timeout()
    read_fd, write_fd = os.pipe()
    for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
        stream.flush()
    # The child's garbage collector never sees this process's objects: collecting garbage
    # it inherited could run native destructors that wait for threads the child does not
    # have (an ONNX Runtime session waits on its pool's condition variables forever).
    gc.freeze()
    try:
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            _child_main(work, write_fd)
    finally:
        gc.unfreeze()
    os.close(write_fd)
    reaped = False
    try:
        data = _read_until_eof(read_fd, pid, timeout)
        _, status = os.waitpid(pid, 0)
        reaped = True
    finally:
        os.close(read_fd)
        if not reaped:  # a timeout or an interrupt here: the child is stopped
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0 or not data:
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        raise CompileError(
            f"the compile child {how} before it reported a result (its output "
            "is above); compile_in='process' compiles in this process"
        )
    return Relay.from_json(json.loads(data))


def compile_timeout() -> float:
    """Seconds a compile child may run: ``PE_COMPILE_TIMEOUT``, else ``TIMEOUT_S``."""
    text = os.environ.get("PE_COMPILE_TIMEOUT") or str(TIMEOUT_S)
    try:
        timeout = float(text)
    except ValueError:
        timeout = float("nan")
    if not timeout > 0:
        raise CompileError(f"PE_COMPILE_TIMEOUT must be a number of seconds > 0, got {text!r}")
    return timeout


def _read_until_eof(fd: int, pid: int, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    chunks: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        ready = select.select([fd], [], [], max(left, 0.0))[0] if left > 0 else []
        if not ready:
            raise CompileError(
                f"the compile child (pid {pid}) did not finish in {timeout:g} s "
                "(PE_COMPILE_TIMEOUT); it was stopped"
            )
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _child_main(work: Callable[[], None], fd: int) -> NoReturn:
    """The child: one torch thread, ``work()`` with its warnings and logs captured, the
    report written to ``fd``, then ``os._exit`` (no atexit, no parent's cleanup)."""
    code = _FAILED
    try:  # the parent's objects stay frozen here (``_run_forked``); this never returns
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(1)
        relay = capture(work)
        with os.fdopen(fd, "wb") as pipe:
            pipe.write(json.dumps(relay.to_json()).encode())
        code = 0
    except BaseException:  # the exit status reports it; the parent raises
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


# -- the parent ----------------------------------------------------------------------------
def _read_parts(
    folder: Path,
    module: Any | None,
    optimizer: Optimizer,
    scheme: Scheme | None,
    passes: Sequence[Pass],
) -> StepParts:
    """The parts the child wrote into ``folder``, the module's tensors bound by name."""
    meta = json.loads((folder / META).read_text(encoding="utf-8"))
    graph = read_graph(folder / GRAPH, meta["graph_sha256"])
    forward = _PackedGraph.read(folder / FORWARD, meta["forward_sha256"])
    facts, batch_names, info, resolution = read_facts(meta)
    values = read_tensors(folder / STATE)
    for name, (dtype, shape) in meta["zeros"].items():
        values[name] = np.zeros(shape, np.dtype(dtype))
    values.update(_module_arrays(module, meta["from_module"]))
    check_state(graph, values, folder / STATE)
    inputs = {v.name: v for v in graph.inputs if v.role is Role.INPUT}
    facts = dataclasses.replace(facts, batch=tuple(inputs[n] for n in batch_names))
    return StepParts(
        forward, graph, facts, values, optimizer, resolution, info, scheme, tuple(passes)
    )


@dataclasses.dataclass(frozen=True)
class _PackedGraph:
    """A graph's IR text, compressed, parsed when called: the forward graph, which only
    ``gradients``, ``report`` and ``evaluator`` read (parsed, MobileNetV2's takes 0.7 MiB
    of Python objects in the process that trains; as text, zlib-compressed, 13 KiB)."""

    packed: bytes
    path: Path

    @classmethod
    def read(cls, path: Path, digest: str) -> _PackedGraph:
        return cls(zlib.compress(read_graph_text(path, digest).encode("utf-8")), path)

    def __call__(self) -> Graph:
        return parse_graph_text(zlib.decompress(self.packed).decode("utf-8"), self.path)


def _module_arrays(module: Any | None, names: dict[str, str]) -> dict[str, Array]:
    """The module's own memory under each IR name, read-only (as the torch frontend
    shares it: the step copies what it writes)."""
    if not names:
        return {}
    assert module is not None, "only a torch module's values are named"
    tensors = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(module.named_buffers(remove_duplicate=False))
    out = {}
    for ir, name in names.items():
        array: Array = tensors[name].detach().numpy()
        array.flags.writeable = False
        out[ir] = array
    return out
