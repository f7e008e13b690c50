"""The C backend against the NumPy backend, and the stand-alone trainer against both.

- every op sample the backend claims (all in one compiled graph), in float64 to 1e-9;
- zoo models: the same gradients, then five steps of losses, params, buffers and optimizer
  state (MobileNetV2 in float64, under ``-m slow``);
- the arena is the memory plan, the source is one statement per node under its IR text,
  and a step makes no heap allocation (an LD_PRELOAD malloc counter built here);
- ops it lacks are listed at once; the exported folder builds with ``make``, its ``train``
  gives the in-process losses and state, refuses a batch of the wrong shape, and
  cross-compiles for aarch64 (run under qemu when installed).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pockengine as pe
from pockengine import zoo
from pockengine.backends import get_backend
from pockengine.backends.c import CBackend, CExecutable, claims, toolchain
from pockengine.backends.c.backend import KERNELS
from pockengine.backends.c.export import read_safetensors
from pockengine.backends.c.views import step_views
from pockengine.backends.numpy.backend import NumpyBackend
from pockengine.frontend.import_memo import reused_imports
from pockengine.ir import (
    DType,
    Graph,
    GraphBuilder,
    OpDef,
    Role,
    Sample,
    TensorType,
    UnsupportedOpError,
    Value,
    all_ops,
)
from tests.cached_cc import make_trainer

Array = np.ndarray[Any, Any]
pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler (cc or $CC)")  # fmt: skip


def _type_of(a: Array) -> TensorType:
    return TensorType(a.shape, DType.from_numpy(a.dtype))


def _cases() -> list[tuple[str, OpDef, Sample]]:
    cases = []
    for name, opdef in sorted(all_ops().items()):
        samples = opdef.samples(np.random.default_rng(0)) if opdef.samples else []
        cases += [(f"{name}-{i}", opdef, s) for i, s in enumerate(samples)]
    return cases


def _ident(label: str) -> str:
    return label.replace("-", "_")


def _add_case(b: GraphBuilder, label: str, opdef: OpDef, sample: Sample) -> list[Value]:
    xs = [
        b.input(
            f"{_ident(label)}.x{i}", _type_of(a), Role.STATE if i in opdef.mutates else Role.INPUT
        )
        for i, a in enumerate(sample.inputs)
    ]
    return list(b.call_multi(opdef.name, *xs, source=label, **sample.attrs))


def _claimed(opdef: OpDef, sample: Sample) -> bool:
    b = GraphBuilder("probe")
    _add_case(b, "probe", opdef, sample)
    return all(claims(n) for n in b.nodes)


_CLAIMED = [c for c in _cases() if _claimed(c[1], c[2])]


@pytest.fixture(scope="module")
def op_results() -> dict[str, tuple[list[Array], list[Array]]]:
    """Every claimed sample as one node of one graph, run by both backends: case label ->
    (C results, NumPy results), the written state of effectful ops appended."""
    b = GraphBuilder("op_samples")
    owned: dict[str, tuple[int, int]] = {}
    outs: list[Value] = []
    for label, opdef, sample in _CLAIMED:
        results = _add_case(b, label, opdef, sample)
        owned[label] = (len(outs), len(results))
        outs += results
    graph = b.build(outs)
    feeds = {f"{_ident(label)}.x{i}": a for label, _, s in _CLAIMED for i, a in enumerate(s.inputs)}
    store_c = {k: np.array(a) for k, a in feeds.items()}
    store_np = {k: np.array(a) for k, a in feeds.items()}
    got = CBackend().compile(graph).run(store_c, {})
    want = NumpyBackend().compile(graph).run(store_np)
    table = {}
    for label, opdef, _ in _CLAIMED:
        start, n = owned[label]
        written = [f"{_ident(label)}.x{i}" for i in opdef.mutates]
        table[label] = (
            got[start : start + n] + [store_c[k] for k in written],
            want[start : start + n] + [store_np[k] for k in written],
        )
    return table


@pytest.mark.parametrize("label", [c[0] for c in _CLAIMED])
def test_op_sample_matches_numpy(label: str, op_results: dict[str, Any]) -> None:
    got, want = op_results[label]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, (label, g.dtype, w.dtype, g.shape)
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-9, err_msg=label)


def test_dropout_mask_equals_numpy_for_negative_seeds_and_salts() -> None:
    """The counter hash's arithmetic shifts and masks on negative int64 seeds and salts."""
    b = GraphBuilder("mask")
    seed = b.input("seed", TensorType((), DType.I64), Role.INPUT)
    outs = [b.call("random_mask", seed, shape=(64, 33), p=p, salt=salt, source="m")
            for p, salt in ((0.3, -7), (0.0, 3), (1.0, 5), (0.5, 2**40))]  # fmt: skip
    graph = b.build(outs)
    for value in (-987654321012, 2**40 + 17, 0):
        feeds = {"seed": np.asarray(value, dtype=np.int64)}
        got = CBackend().compile(graph).run(dict(feeds), {})
        want = NumpyBackend().compile(graph).run(dict(feeds))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
        assert 0 < np.count_nonzero(got[0]) < got[0].size  # p = 0.3 keeps some, drops some


def test_every_op_of_the_cnn_workloads_is_claimed() -> None:
    """MLP, small CNN and MobileNetV2 (every scheme) run entirely in C."""
    makers: list[Callable[[], zoo.Workload]] = [
        zoo.mlp, zoo.small_cnn, lambda: zoo.mobilenet_v2(0.35, batch=1, size=64),
    ]  # fmt: skip
    for make in makers:
        w = make()
        with reused_imports():  # one torch.export of each model for its three schemes
            for scheme in (None, pe.schemes.sparse(blocks=2), pe.schemes.bias_only()):
                step = pe.compile(w.model, w.loss_fn, w.make_batch(0), scheme=scheme)
                missing = sorted({n.op for n in step.graph.nodes if not claims(n)})
                assert missing == [], (w.name, missing)


def test_missing_ops_are_listed_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(KERNELS, "cumsum")  # as if the backend had no cumsum kernel
    b = GraphBuilder("g")
    x = b.input("x", TensorType((2, 3), DType.F32), Role.INPUT)
    y = b.call("relu", x, source="a.py:1")
    z = b.call("cumsum", y, axis=1, source="b.py:2")
    h = b.input("h", TensorType((2, 3), DType.F16), Role.INPUT)
    out = b.call("add", b.call("cast", z, dtype="f16", source="c.py:3"), h, source="d.py:4")
    with pytest.raises(UnsupportedOpError) as err:
        CBackend().compile(b.build([out]))
    text = str(err.value)
    assert "cumsum" in text and "b.py:2" in text and "f16" in text and "d.py:4" in text
    assert "relu" not in text


# -- whole models ----------------------------------------------------------------------------
def _sgd() -> pe.optim.Optimizer:
    return pe.optim.SGD(lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True)


def _adamw(lr: float = 1e-3) -> pe.optim.Optimizer:
    return pe.optim.AdamW(lr=lr, weight_decay=0.01, eps=1e-5)  # eps: see test_torch_backend


def _close(got: dict[str, Array], want: dict[str, Array], what: str) -> None:
    assert set(got) == set(want), what
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5, err_msg=f"{what} {name}")


def _train_both(w: zoo.Workload, optimizer: Any, scheme: Any = None) -> None:
    batch = w.make_batch(0)
    ref = pe.compile(w.model, w.loss_fn, batch, optimizer=optimizer(), scheme=scheme)
    ours = pe.compile(w.model, w.loss_fn, batch, optimizer=optimizer(), scheme=scheme,
                      backend="c")  # fmt: skip
    _close(ours.gradients(*batch), ref.gradients(*batch), "gradient")
    for i in range(5):
        batch = w.make_batch(i)
        want, got = ref(*batch), ours(*batch)
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5), (i, got, want)
    _close(ours.state_dict(), ref.state_dict(), "state")
    _close(ours.optimizer_state(), ref.optimizer_state(), "optimizer state")


@pytest.mark.parametrize(
    ("make", "optimizer"),
    [
        (zoo.mlp, _sgd),
        (zoo.mlp, _adamw),
        (zoo.small_cnn, _sgd),
        (zoo.small_cnn, _adamw),
        # a BERT or LLaMA step takes about 20 s to compile at -O3: pytest -m slow
        pytest.param(zoo.bert_classifier, _adamw, marks=pytest.mark.slow),
        pytest.param(zoo.llama_lm, _adamw, marks=pytest.mark.slow),
    ],
    ids=["mlp-sgd", "mlp-adamw", "cnn-sgd", "cnn-adamw", "bert-adamw", "llama-adamw"],
)
def test_training_matches_numpy(make: Any, optimizer: Any) -> None:
    _train_both(make(), optimizer)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", [None, "sparse"])
def test_mobilenet_training_matches_numpy(scheme: str | None) -> None:
    """Float64, batch 4 at 64x64, AdamW at lr 1e-4 (float32 gradients of this randomly
    initialised network are ill-conditioned, and larger steps make its trajectory chaotic;
    see test_torch_backend._mobilenet)."""
    w = zoo.as_double(zoo.mobilenet_v2(width=0.35, batch=4, size=64))
    _train_both(w, lambda: _adamw(1e-4), pe.schemes.sparse(blocks=4) if scheme else None)


def test_unclaimed_nodes_fall_back_to_the_next_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a C cumsum kernel, backend=["c", "torch"] runs cumsum on torch, the rest in C,
    and training matches the NumPy oracle."""
    import torch

    monkeypatch.delitem(KERNELS, "cumsum")
    w = zoo.mlp()

    class Cumulative(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> Any:
            return self.inner(torch.cumsum(x, 1))

    batch = w.make_batch(0)
    mixed = pe.compile(Cumulative(w.model), w.loss_fn, batch, backend=["c", "torch"])
    ref = pe.compile(Cumulative(w.model), w.loss_fn, batch)
    placement = mixed.report().placement
    assert placement is not None
    ops = dict(zip(placement.ops, placement.assignment, strict=True))
    assert placement.backends[ops["cumsum"]] == "torch" and placement.backends[ops["linear"]] == "c"
    for i in range(3):
        assert mixed(*w.make_batch(i)) == pytest.approx(ref(*w.make_batch(i)), rel=1e-5)


# -- the arena, the source, no allocation ------------------------------------------------------
@pytest.fixture(scope="module")
def cnn_step() -> Any:
    w = zoo.small_cnn()
    return pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=_sgd(), backend="c"), w


def test_arena_is_the_plan_and_source_one_statement_per_node(cnn_step: Any) -> None:
    step, _ = cnn_step
    ex = step._exec
    assert isinstance(ex, CExecutable)
    assert ex.arena.nbytes == ex.plan.arena_bytes and ex.arena.ctypes.data % 64 == 0
    views = step_views(step.graph)
    for node in step.graph.nodes:
        for v in node.outputs:
            if v.name in views and views[v.name].root not in ex.plan.offsets:
                continue  # a view of a graph input: no arena bytes (test_c_views.py)
            assert f"*)(A + {ex.plan.offsets[v.name]});" in ex.source, v.name
    assert step.source == ex.source
    comments = [line for line in ex.source.splitlines() if line.startswith("    /* ")]
    assert len(comments) == len(step.graph.nodes)
    convs = [c for c in comments if "= conv2d(" in c]
    assert convs and "= conv2d(batch.0, stem.weight" in convs[0]
    lines = ex.source.splitlines()
    statements = [lines[k + 1] for k, line in enumerate(lines) if line.startswith("    /* ")]
    assert all(s.startswith("    ") and not s.startswith("    /*") for s in statements)
    assert sum(s == "    (void)0; /* a view: no statement */" for s in statements) == len(views)


_COUNTER = r"""
#include <stddef.h>
extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
static volatile int counting;
static volatile long count;
void *malloc(size_t n) { if (counting) count++; return __libc_malloc(n); }
void *calloc(size_t a, size_t b) { if (counting) count++; return __libc_calloc(a, b); }
void *realloc(void *p, size_t n) { if (counting) count++; return __libc_realloc(p, n); }
void *aligned_alloc(size_t a, size_t n) { if (counting) count++; return __libc_memalign(a, n); }
int posix_memalign(void **p, size_t a, size_t n) {
    if (counting) count++;
    *p = __libc_memalign(a, n);
    return *p ? 0 : 12;
}
long pe_count_allocations(void (*step)(void *, void *), void *arena, void *args) {
    count = 0;
    counting = 1;
    step(arena, args);
    counting = 0;
    return count;
}
"""

_COUNT_SCRIPT = """
import ctypes, sys
import numpy as np
from pockengine.backends.c import CBackend
from pockengine.ir import Role
from pockengine.ir.parser import parse_graph
graph = parse_graph(open(sys.argv[2]).read())
rng = np.random.default_rng(0)
store = {v.name: (rng.random(v.shape) * 0.1).astype(v.dtype.to_numpy())
         for v in graph.inputs if v.role is not Role.INPUT}
feeds = {v.name: np.zeros(v.shape, v.dtype.to_numpy()) for v in graph.inputs
         if v.role is Role.INPUT}
executable = CBackend().compile(graph)
executable.run(store, feeds)  # warm-up: the OpenMP thread pool starts here
bound = executable.bind(store, feeds)
counter = ctypes.CDLL(sys.argv[1])
counter.pe_count_allocations.restype = ctypes.c_long
address = ctypes.cast(bound.function, ctypes.c_void_p)
print(counter.pe_count_allocations(address, ctypes.c_void_p(bound.arena), bound.args))
"""


def _winograd4_step() -> Any:
    """A step whose 3x3 convolutions take Winograd F(4x4, 3x3) by the rule, all three ops."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(16 * 16 * 16, 4))  # fmt: skip

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(m(x), y)

    batch = (torch.randn(2, 3, 16, 16), torch.tensor([0, 3]))
    step = pe.compile(model, loss_fn, batch, optimizer=_sgd(), backend="c")
    for op in ("conv2d", "conv2d_input_grad", "conv2d_weight_grad"):
        assert f"pe_{op}_winograd4_f32(" in step._exec.source
    return step


@pytest.mark.skipif(sys.platform != "linux", reason="the counter replaces glibc's malloc")
@pytest.mark.parametrize("model", ["cnn", "winograd4"])
def test_a_step_makes_no_heap_allocation(tmp_path: Path, cnn_step: Any, model: str) -> None:
    """The CNN's training step, and one on Winograd F(4x4, 3x3) (its working memory is a
    slot of the plan), parsed back from its IR text in a process without torch (torch
    bundles an older libgomp that allocates a team per parallel region; the system's reuses
    it). The counter (LD_PRELOAD) proves itself first."""
    src, lib, text = tmp_path / "counter.c", tmp_path / "libcounter.so", tmp_path / "g.txt"
    src.write_text(_COUNTER)
    step = cnn_step[0] if model == "cnn" else _winograd4_step()
    text.write_text(str(step.graph))
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", str(src), "-o", str(lib)], check=True)
    env = {**os.environ, "LD_PRELOAD": str(lib), "OMP_NUM_THREADS": "2"}
    probe = (
        "import ctypes,sys; c=ctypes.CDLL(sys.argv[1]); "
        "c.pe_count_allocations.restype=ctypes.c_long;"
        "f=ctypes.CFUNCTYPE(None,ctypes.c_void_p,ctypes.c_void_p)(lambda a,b: c.malloc(8));"
        "print(c.pe_count_allocations(f,None,None))"
    )
    counted = subprocess.run([sys.executable, "-c", probe, str(lib)], env=env,
                             capture_output=True, text=True, check=True)  # fmt: skip
    assert int(counted.stdout.split()[-1]) >= 1
    done = subprocess.run([sys.executable, "-c", _COUNT_SCRIPT, str(lib), str(text)], env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert done.stdout.strip().splitlines()[-1] == "0", done.stdout


def test_compilation_is_cached_by_source_hash(cnn_step: Any) -> None:
    step, _ = cnn_step
    again = CBackend().compile(step.graph)
    assert again.library_path == step._exec.library_path
    assert again.source == step._exec.source


def test_profile_times_every_node_and_portable_builds_apart(cnn_step: Any) -> None:
    step, w = cnn_step
    profiled = CBackend(profile=True, portable=True).compile(step.graph)
    assert profiled.library_path != step._exec.library_path
    assert "-march=native" not in toolchain(portable=True).flags
    store = {k: np.array(v) for k, v in step._store.items()}
    profiled.run(store, step._feeds(w.make_batch(0)))
    timed = profiled.node_seconds()
    assert len(timed) == len(step.graph.nodes) and all(t >= 0 for t, _ in timed)
    assert sum(t for t, _ in timed) > 0 and "conv2d" in " ".join(text for _, text in timed)


def test_backend_is_registered() -> None:
    assert isinstance(get_backend("c"), CBackend)
    assert "c" in pe.backends.BACKENDS


# -- the stand-alone trainer --------------------------------------------------------------------
def _export_cnn(tmp_path: Path, steps: int = 3) -> tuple[Path, list[float], dict[str, Array]]:
    """Export a fresh CNN step, write 3 batches as stacked .npy, and train the same
    batches in process: (folder, losses, state after)."""
    w = zoo.small_cnn()
    step = pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=_sgd(), backend="c")
    folder = step.export(tmp_path / "trainer", target="c")
    batches = [w.make_batch(i) for i in range(steps)]
    np.save(folder / "X.npy", np.stack([b[0].numpy() for b in batches]))
    np.save(folder / "Y.npy", np.stack([b[1].numpy() for b in batches]))
    losses = [step(*b) for b in batches]
    return folder, losses, step.flat_state_dict()


def _losses(stdout: str) -> list[float]:
    return [float(line.split()[-1]) for line in stdout.splitlines() if line.startswith("step ")]


@pytest.fixture(scope="module")
def built_cnn(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, list[float], dict[str, Array]]:
    """The CNN trainer exported and built once, with its in-process losses and state."""
    folder, losses, state = _export_cnn(tmp_path_factory.mktemp("cnn"))
    assert {p.name for p in folder.iterdir()} >= {
        "step.c", "bounds.c", "main.c", "pe_io.c", "pe_save.c", "pe_check.c", "Makefile",
        "README.md", "state.safetensors", "kernels",
    }  # fmt: skip
    make_trainer(folder)
    return folder, losses, state


def test_exported_trainer_matches_in_process(
    built_cnn: tuple[Path, list[float], dict[str, Array]],
) -> None:
    folder, losses, state = built_cnn
    libs = subprocess.run(["ldd", str(folder / "train")], capture_output=True, text=True).stdout
    assert not [ln for ln in libs.splitlines() if "=>" in ln and not
                any(k in ln for k in ("libc.so", "libm.so"))], libs  # fmt: skip
    run = subprocess.run(["./train", "--save", "out.safetensors", "X.npy", "Y.npy"],
                         cwd=folder, capture_output=True, text=True, check=True)  # fmt: skip
    np.testing.assert_allclose(_losses(run.stdout), losses, rtol=1e-6)
    saved = read_safetensors(folder / "out.safetensors")
    _close({k: saved[k] for k in state}, state, "saved state")
    w = zoo.small_cnn()
    fresh = pe.compile(w.model, w.loss_fn, w.make_batch(0), optimizer=_sgd())
    fresh.load_state(params={k: saved[k] for k in state})
    _close(fresh.flat_state_dict(), state, "loaded state")


def test_trainer_refuses_a_batch_of_the_wrong_shape(
    built_cnn: tuple[Path, list[float], dict[str, Array]],
) -> None:
    folder, _, _ = built_cnn
    np.save(folder / "bad.npy", np.zeros((4, 3, 8, 8), np.float32))
    run = subprocess.run(["./train", "bad.npy", "Y.npy"], cwd=folder, capture_output=True,
                         text=True)  # fmt: skip
    assert run.returncode == 2
    assert "bad.npy" in run.stderr and "float32[4,3,16,16]" in run.stderr, run.stderr
    assert "float32[4,3,8,8]" in run.stderr
    np.save(folder / "ints.npy", np.zeros((4, 3, 16, 16), np.int64))
    run = subprocess.run(["./train", "ints.npy", "Y.npy"], cwd=folder, capture_output=True,
                         text=True)  # fmt: skip
    assert run.returncode == 2 and "int64[4,3,16,16]" in run.stderr, run.stderr


def test_cross_compiled_trainer_runs_under_qemu(tmp_path: Path) -> None:
    """Needs Debian's gcc-aarch64-linux-gnu and qemu-user (CI installs both)."""
    cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cross is None or qemu is None:
        pytest.skip("aarch64-linux-gnu-gcc or qemu-aarch64 missing: apt-get install "
                    "gcc-aarch64-linux-gnu qemu-user")  # fmt: skip
    folder, losses, _ = _export_cnn(tmp_path)
    subprocess.run(["make", "-s", "-C", str(folder), f"CC={cross}"], check=True)
    run = subprocess.run([qemu, "-L", "/usr/aarch64-linux-gnu", "./train", "X.npy", "Y.npy"],
                         cwd=folder, capture_output=True, text=True, check=True)  # fmt: skip
    np.testing.assert_allclose(_losses(run.stdout), losses, rtol=1e-5)


def test_cli_exports_a_c_folder(tmp_path: Path) -> None:
    from pockengine.cli import main

    assert main(["export", "mlp", "--target", "c", "-o", str(tmp_path / "mlp")]) == 0
    source = (tmp_path / "mlp" / "step.c").read_text()
    assert "void pe_step(" in source and (tmp_path / "mlp" / "state.safetensors").exists()
    text = textwrap.dedent((tmp_path / "mlp" / "README.md").read_text())
    assert "./train" in text and "batch.0" in text


def test_large_transposes_are_tiled_and_exact() -> None:
    b = GraphBuilder("g")
    x = b.input("x", TensorType((45, 70), DType.F32), Role.INPUT)
    y = b.input("y", TensorType((2, 33, 40), DType.F64), Role.INPUT)
    graph = b.build([b.call("transpose", x, perm=(1, 0)), b.call("transpose", y, perm=(0, 2, 1))])
    executable = CBackend().compile(graph)
    assert "t0 += 32" in executable.source
    xs = np.arange(45 * 70, dtype=np.float32).reshape(45, 70)
    ys = np.random.default_rng(0).standard_normal((2, 33, 40))
    got = executable.run({}, {"x": xs, "y": ys})
    np.testing.assert_array_equal(got[0], xs.T)
    np.testing.assert_array_equal(got[1], ys.transpose(0, 2, 1))


def test_graph_of_one_node_runs(tmp_path: Path) -> None:
    """A graph output that is a node result and an input fed through the arena."""
    b = GraphBuilder("g")
    x = b.input("x", TensorType((3, 4), DType.F32), Role.INPUT)
    w = b.input("w", TensorType((4, 5), DType.F32), Role.PARAM)
    graph: Graph = b.build([b.call("matmul", x, w)])
    xs, ws = np.ones((3, 4), np.float32), np.arange(20, dtype=np.float32).reshape(4, 5)
    out = CBackend().compile(graph).run({"w": ws}, {"x": xs})[0]
    np.testing.assert_array_equal(out, xs @ ws)


@pytest.mark.parametrize("n", [4, 8, 16, 24, 40])
def test_narrow_products_match_float64(n: int) -> None:
    """Products with fewer columns than the micro-kernel's block (a pointwise convolution
    over a 4x4 map: 16 columns) run the micro-kernel on a zero-padded sliver; K = 300 spans
    two k blocks. Every width agrees with float64 to float32 accuracy."""
    rng = np.random.default_rng(n)
    m, k = 40, 300
    xs = rng.standard_normal((m, k)).astype(np.float32)
    ws = rng.standard_normal((k, n)).astype(np.float32)
    b = GraphBuilder("g")
    x = b.input("x", TensorType((m, k), DType.F32), Role.INPUT)
    w = b.input("w", TensorType((k, n), DType.F32), Role.PARAM)
    out = CBackend().compile(b.build([b.call("matmul", x, w)])).run({"w": ws}, {"x": xs})[0]
    np.testing.assert_allclose(out, xs.astype(np.float64) @ ws, rtol=1e-4, atol=1e-4)


def _sequential_products(a: Array, bs: Array) -> Array:
    """``a @ b`` for each image's ``b``, each element summed over k in order in float32."""
    out = np.zeros((bs.shape[0], a.shape[0], bs.shape[2]), np.float32)
    for j in range(a.shape[1]):
        out = out + a[None, :, j : j + 1] * bs[:, j : j + 1, :]
    return out


def test_pointwise_convolutions_on_small_maps() -> None:
    """A pointwise convolution and its input gradient over 4x4 maps (16 columns an image):
    the images are read side by side as one product (a sliver may straddle two images),
    K = 300 spans two k blocks."""
    rng = np.random.default_rng(3)
    n, c, o = 3, 300, 40
    geometry = {"stride": (1, 1), "padding": (0, 0), "dilation": (1, 1), "groups": 1}
    xs = rng.standard_normal((n, c, 4, 4)).astype(np.float32)
    gs = rng.standard_normal((n, o, 4, 4)).astype(np.float32)
    ws = rng.standard_normal((o, c, 1, 1)).astype(np.float32)
    b = GraphBuilder("g")
    x = b.input("x", TensorType(xs.shape, DType.F32), Role.INPUT)
    gy = b.input("gy", TensorType(gs.shape, DType.F32), Role.INPUT)
    w = b.input("w", TensorType(ws.shape, DType.F32), Role.PARAM)
    y = b.call("conv2d", x, w, **geometry)
    gx = b.call("conv2d_input_grad", gy, w, x_shape=xs.shape, **geometry)
    got = CBackend().compile(b.build([y, gx])).run({"w": ws}, {"x": xs, "gy": gs})
    w2 = ws[:, :, 0, 0]
    want_y = _sequential_products(w2, xs.reshape(n, c, 16)).reshape(n, o, 4, 4)
    want_gx = _sequential_products(w2.T.copy(), gs.reshape(n, o, 16)).reshape(n, c, 4, 4)
    np.testing.assert_allclose(got[0], want_y, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[1], want_gx, rtol=1e-4, atol=1e-4)
