"""Train with a step exported by PockEngine, using ONNX Runtime alone.

This file imports only numpy and onnxruntime (and ``safetensors.numpy`` when it is there,
to save weights): copy it next to the exported ``train_step.onnx`` and
``train_step.state.npz`` and run, on any machine with those two packages::

    python ort_runner.py train_step.onnx --batches batches.npz --steps 100 \\
        --save weights.safetensors

``batches.npz`` holds one array per batch input (named as the step's inputs, or "0",
"1", ... in call order), each with a leading axis of batches; step k uses batch k modulo
their number. Or, from Python::

    from ort_runner import TrainingSession
    session = TrainingSession("train_step.onnx")
    loss = session.step(x, y)
    session.save("weights.safetensors")   # params and buffers, under the model's names

The step's params, buffers and optimizer state live in OrtValues; each step binds the
outputs that hold their new values to spare buffers and swaps them in afterwards, so
nothing is copied between steps but the batch and the loss.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import IO, Any

import numpy as np
import onnxruntime as ort

__all__ = ["TrainingSession", "main"]

_DTYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
}
_LR = "optim.lr"


class TrainingSession:
    """An exported training step with its state: ``step(*batch)`` trains once."""

    def __init__(
        self,
        path: str,
        state: str | None = None,
        providers: Sequence[str] | None = None,
        threads: int | None = None,
    ) -> None:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if threads:
            options.intra_op_num_threads = threads
        if providers is None:
            cuda = "CUDAExecutionProvider" in ort.get_available_providers()
            providers = ["CUDAExecutionProvider"] if cuda else []
            providers = [*providers, "CPUExecutionProvider"]
        self.device = "cuda" if providers[0].startswith("CUDA") else "cpu"
        self.session = ort.InferenceSession(os.fspath(path), options, providers=list(providers))
        meta = self.session.get_modelmeta().custom_metadata_map
        if meta.get("pockengine.format") != "1":
            raise ValueError(f"{path} is not a training step exported by PockEngine")
        self.batch_names: list[str] = json.loads(meta["pockengine.batch"])
        self.loss_name = meta["pockengine.loss"]
        self.updates: dict[str, str] = json.loads(meta["pockengine.updates"])
        self.state_names: dict[str, str] = json.loads(meta["pockengine.state_names"])
        self.aliases: dict[str, list[str]] = json.loads(meta["pockengine.aliases"])
        self._dtypes = {i.name: _DTYPES.get(i.type) for i in self.session.get_inputs()}
        if state is None:
            state = os.path.join(os.path.dirname(os.fspath(path)), meta["pockengine.state_file"])
        with np.load(state) as data:
            self._state = {name: self._ortvalue(data[name]) for name in data.files}
        missing = [n for n in self._dtypes if n not in self._state and n not in self.batch_names]
        if missing:
            raise ValueError(f"the state file {state} lacks {missing}")
        self._binding = self.session.io_binding()
        self._bound: dict[str, Any] = {}
        self._spare: dict[str, Any] = {}
        self.steps = 0
        self.skipped_steps = 0  # non-finite losses: the step wrote nothing

    def _ortvalue(self, array: Any) -> Any:
        array = np.array(array, order="C")  # owned by the OrtValue: copied in
        value = ort.OrtValue.ortvalue_from_shape_and_type(array.shape, array.dtype, self.device, 0)
        value.update_inplace(array)
        return value

    def _bind(self, name: str, value: Any) -> None:
        if self._bound.get(name) is not value:
            self._binding.bind_ortvalue_input(name, value)
            self._bound[name] = value

    def step(self, *batch: Any) -> float:
        """Train on one batch (arrays in the step's input order); returns the loss."""
        if len(batch) != len(self.batch_names):
            raise ValueError(f"expected {len(self.batch_names)} batch arrays, got {len(batch)}")
        for name, item in zip(self.batch_names, batch, strict=True):
            self._bind(name, self._ortvalue(np.asarray(item, dtype=self._dtypes[name])))
        for name, value in self._state.items():
            if name in self._dtypes:
                self._bind(name, value)
        binding = self._binding
        binding.clear_binding_outputs()
        binding.bind_output(self.loss_name, self.device)
        targets = {}
        for old, new in self.updates.items():
            spare = self._spare.get(old)
            if spare is None:
                spare = self._ortvalue(np.empty(self._state[old].shape(), self._dtypes[old]))
            binding.bind_ortvalue_output(new, spare)
            targets[old] = spare
        self.session.run_with_iobinding(binding)
        for old, written in targets.items():
            self._spare[old], self._state[old] = self._state[old], written
        self.steps += 1
        loss = float(binding.get_outputs()[0].numpy())
        if not math.isfinite(loss):  # the graph's gate wrote every state value back unchanged
            self.skipped_steps += 1
        return loss

    @property
    def lr(self) -> float:
        return float(self._state[_LR].numpy())

    @lr.setter
    def lr(self, value: float) -> None:
        if not (math.isfinite(float(value)) and float(value) > 0):
            raise ValueError(f"lr must be a finite number > 0, got {value!r}")
        self._state[_LR] = self._ortvalue(np.asarray(value, dtype=np.float32))

    def state_dict(self) -> dict[str, Any]:
        """Params and buffers under the model's names (tied ones under each name)."""
        out = {}
        for ir, name in self.state_names.items():
            value = np.array(self._state[ir].numpy(), copy=True)
            for alias in self.aliases.get(name, [name]):
                out[alias] = value.copy()
        return out

    def save(self, path: str) -> str:
        """Write the weights: safetensors when ``safetensors`` is installed and ``path`` ends
        with .safetensors, else .npz; returns the path written. The file is written under a
        temporary name beside ``path`` and renamed into place; a link at ``path`` is refused."""
        weights = self.state_dict()
        if path.endswith(".safetensors"):
            try:
                from safetensors.numpy import save
            except ImportError:
                path = path[: -len(".safetensors")] + ".npz"
            else:
                data = save({k: np.ascontiguousarray(v) for k, v in weights.items()})
                _write_replacing(path, lambda f: f.write(data))
                return path
        _write_replacing(path, lambda f: np.savez(f, **weights))
        return path

    def save_state(self, path: str) -> None:
        """Write every state value (to resume with ``TrainingSession(model, state=path)``),
        under a temporary name renamed into place."""
        arrays: dict[str, Any] = {k: np.array(v.numpy(), copy=True) for k, v in self._state.items()}
        _write_replacing(path, lambda f: np.savez(f, **arrays))


def _write_replacing(path: str, fill: Callable[[IO[bytes]], object]) -> None:
    """Write ``path`` through a new temporary file in its folder, then rename it into place,
    so a failed write leaves the old file; a symbolic link at ``path`` is refused, never
    followed."""
    if os.path.islink(path):
        raise SystemExit(f"error: {path} is a symbolic link; refusing to write through it")
    folder = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(temporary, flags, 0o644)
    except OSError as e:
        raise SystemExit(f"error: cannot write {path}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.lexists(temporary):
            os.unlink(temporary)
        raise


def _batches(path: str, names: list[str]) -> list[Any]:
    with np.load(path) as data:
        keys = [n if n in data.files else str(i) for i, n in enumerate(names)]
        missing = [k for k in keys if k not in data.files]
        if missing:
            raise SystemExit(f"{path} lacks the batch inputs {missing} (it has {data.files})")
        return [data[k] for k in keys]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="the exported train_step.onnx")
    parser.add_argument("--state", help="state file (default: the one beside the model)")
    parser.add_argument("--batches", required=True, help=".npz of stacked batch arrays")
    parser.add_argument("--steps", type=int, help="steps to run (default: one per batch)")
    parser.add_argument("--lr", type=float, help="set the learning rate first")
    parser.add_argument("--threads", type=int, help="intra-op threads")
    parser.add_argument("--save", help="write the weights (.safetensors or .npz)")
    parser.add_argument("--save-state", help="write the whole state (.npz) to resume from")
    parser.add_argument("--json", action="store_true", help="print the losses as one JSON list")
    args = parser.parse_args(argv)
    session = TrainingSession(args.model, args.state, threads=args.threads)
    if args.lr is not None:
        session.lr = args.lr
    stacked = _batches(args.batches, session.batch_names)
    count = len(stacked[0])
    losses = []
    for k in range(args.steps if args.steps is not None else count):
        losses.append(session.step(*(a[k % count] for a in stacked)))
        if not args.json:
            print(f"step {k:5d}  loss {losses[-1]:.6f}")
    if args.json:
        print(json.dumps(losses))
    if args.save:
        print(f"saved {session.save(args.save)}", file=sys.stderr)
    if args.save_state:
        session.save_state(args.save_state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
