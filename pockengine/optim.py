"""Optimizers, lowered to effectful update nodes of the training graph.

An optimizer adds its state to the graph as inputs with the STATE role (the
learning rate, the step count, one momentum or two moment tensors per trained
parameter) and emits one update node per trained parameter. The learning rate
is a scalar state value, so a schedule sets it between steps without
recompiling.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pockengine.ir import CompileError, DType, GraphBuilder, Phase, Role, TensorType, Value
from pockengine.ir.arrays import Array
from pockengine.ops.update_8bit import ZERO_BYTE

__all__ = ["MIN_8BIT_SIZE", "SGD", "STATE_DTYPES", "AdamW", "Optimizer", "linear_schedule"]


LR = "optim.lr"
STEP = "optim.step"


class Optimizer(ABC):
    """Base of the optimizers: ``build`` adds state and update nodes to a training graph."""

    lr: float

    def build(
        self, b: GraphBuilder, pairs: Sequence[tuple[Value, Value]], skip: Value | None = None
    ) -> dict[str, Array]:
        """Emit the updates of each (param, grad) pair (``Phase.UPDATE`` nodes); return the
        state's initial values. ``skip`` (an f32 scalar, 1.0 on a non-finite loss) becomes
        every update's last input: a skipped step leaves params and state as they were."""
        init: dict[str, Array] = {}
        scalar = TensorType((), DType.F32)
        lr = b.input(LR, scalar, Role.STATE)
        init[LR] = np.asarray(self.lr, dtype=np.float32)
        gate = () if skip is None else (skip,)
        with b.in_phase(Phase.UPDATE):
            self._emit(b, pairs, lr, init, gate)
        return init

    @abstractmethod
    def _emit(
        self,
        b: GraphBuilder,
        pairs: Sequence[tuple[Value, Value]],
        lr: Value,
        init: dict[str, Array],
        gate: tuple[Value, ...],
    ) -> None: ...

    @staticmethod
    def _state_like(
        b: GraphBuilder, kind: str, param: Value, grad: Value, init: dict[str, Array]
    ) -> Value:
        """Per-param state, shaped like the gradient (the trained rows only, if partial)."""
        name = f"optim.{kind}.{param.name}"
        init[name] = np.zeros(grad.shape, dtype=grad.dtype.to_numpy())
        return b.input(name, grad.type, Role.STATE)

    @staticmethod
    def _step_count(b: GraphBuilder, init: dict[str, Array]) -> tuple[Value, Value]:
        """The stored step count and the count after this step (store it with ``assign``)."""
        step = b.input(STEP, TensorType((), DType.F32), Role.STATE)
        init[STEP] = np.zeros((), dtype=np.float32)
        one = b.scalar(1.0, DType.F32, source="optim")
        return step, b.call("add", step, one, source="optim")


def _rows(param: Value, grad: Value) -> dict[str, int]:
    """The ``rows`` attr of a partial-channel update: the gradient covers leading rows."""
    return {} if grad.shape == param.shape else {"rows": grad.shape[0]}


def _check(name: str, value: float, low: float, high: float = float("inf")) -> None:
    """A finite ``value`` in ``[low, high]``, else a ``CompileError`` naming it."""
    if not (isinstance(value, int | float) and math.isfinite(value) and low <= value <= high):
        raise CompileError(f"{name}={value!r} must be a finite number in [{low}, {high}]")


@dataclass(frozen=True)
class SGD(Optimizer):
    """torch.optim.SGD with momentum, weight decay and Nesterov (dampening 0)."""

    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        _check("lr", self.lr, 0.0)
        _check("momentum", self.momentum, 0.0, 1.0)
        _check("weight_decay", self.weight_decay, 0.0)
        if self.nesterov and self.momentum == 0:
            raise CompileError("Nesterov momentum needs momentum > 0")

    def _emit(
        self,
        b: GraphBuilder,
        pairs: Sequence[tuple[Value, Value]],
        lr: Value,
        init: dict[str, Array],
        gate: tuple[Value, ...],
    ) -> None:
        for param, grad in pairs:
            source = f"optim {param.name}"
            rows = _rows(param, grad)
            if self.momentum == 0:
                wd = self.weight_decay
                b.effect(
                    "sgd_update", param, grad, lr, *gate, weight_decay=wd, source=source, **rows
                )
                continue
            buf = self._state_like(b, "momentum", param, grad, init)
            b.effect(
                "sgd_momentum_update",
                param,
                grad,
                buf,
                lr,
                *gate,
                momentum=self.momentum,
                weight_decay=self.weight_decay,
                nesterov=self.nesterov,
                source=source,
                **rows,
            )


STATE_DTYPES = ("float32", "int8")
MIN_8BIT_SIZE = 4096  # smaller moments stay float (as bitsandbytes' ``min_8bit_size``)


@dataclass(frozen=True)
class AdamW(Optimizer):
    """torch.optim.AdamW (decoupled weight decay, bias-corrected moments).

    ``state_dtype="int8"`` stores the moments of each param with at least
    ``MIN_8BIT_SIZE`` trained elements as bytes with one absmax per ``block`` elements
    (after bitsandbytes' 8-bit Adam, the second moment as its square root;
    ``pockengine.ops.update_8bit``): a quarter of float32's bytes. Smaller params (norm
    weights, biases) keep float32 moments."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    state_dtype: str = "float32"
    block: int = 256

    def __post_init__(self) -> None:
        _check("lr", self.lr, 0.0)
        _check("beta1", self.betas[0], 0.0, 1.0)
        _check("beta2", self.betas[1], 0.0, 1.0)
        _check("eps", self.eps, 0.0)
        _check("weight_decay", self.weight_decay, 0.0)
        if self.state_dtype not in STATE_DTYPES:
            raise CompileError(
                f"AdamW state_dtype={self.state_dtype!r}: expected one of {list(STATE_DTYPES)}"
            )
        if not (isinstance(self.block, int) and self.block >= 1):
            raise CompileError(f"AdamW block={self.block!r} must be an int >= 1")

    def _hyper(self, param: Value, grad: Value) -> dict[str, Any]:
        return {
            "beta1": self.betas[0],
            "beta2": self.betas[1],
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "source": f"optim {param.name}",
            **_rows(param, grad),
        }

    def _emit(
        self,
        b: GraphBuilder,
        pairs: Sequence[tuple[Value, Value]],
        lr: Value,
        init: dict[str, Array],
        gate: tuple[Value, ...],
    ) -> None:
        step, t = self._step_count(b, init)
        for param, grad in pairs:
            if self.state_dtype == "int8" and grad.type.numel >= MIN_8BIT_SIZE:
                state = self._state_8bit(b, param, grad, init)
                b.effect(
                    "adamw8bit_update",
                    param,
                    grad,
                    *state,
                    t,
                    lr,
                    *gate,
                    block=self.block,
                    **self._hyper(param, grad),
                )
                continue
            m = self._state_like(b, "exp_avg", param, grad, init)
            v = self._state_like(b, "exp_avg_sq", param, grad, init)
            b.effect("adamw_update", param, grad, m, v, t, lr, *gate, **self._hyper(param, grad))
        b.effect("assign", step, t, *gate, source="optim")

    def _state_8bit(
        self, b: GraphBuilder, param: Value, grad: Value, init: dict[str, Array]
    ) -> tuple[Value, ...]:
        """Bytes and absmax of both moments, all encoding zero (``update_8bit``)."""
        blocks = TensorType((-(-grad.type.numel // self.block),), grad.dtype)
        out = []
        for kind, code in (("exp_avg", "signed"), ("exp_avg_sq", "unsigned")):
            codes = f"optim.{kind}.{param.name}.codes"
            init[codes] = np.full(grad.shape, ZERO_BYTE[code], dtype=np.uint8)
            out.append(b.input(codes, TensorType(grad.shape, DType.U8), Role.STATE))
            absmax = f"optim.{kind}.{param.name}.absmax"
            init[absmax] = np.zeros(blocks.shape, dtype=grad.dtype.to_numpy())
            out.append(b.input(absmax, blocks, Role.STATE))
        return tuple(out)


def linear_schedule(t: int, base: float, warmup: int, total: int) -> float:
    """The learning rate of step ``t`` (0-based): rising to ``base`` over ``warmup``
    steps, then falling linearly to zero at ``total``."""
    if t < warmup:
        return base * (t + 1) / warmup
    # After a warmup, whose last step already ran at ``base``, decay starts below it.
    return base * max(0.0, (total - t) / max(1, total - warmup + (warmup > 0)))
