"""One torch.export per model state, batch and mode, where a process imports the same
model more than once (``reused_imports``).

An import (``torch.export``, decomposition to core ATen, translation) takes seconds: 2-3
for lite0-fashion, about 15 for SmolLM2-135M. ``--scheme auto``'s analysis imports the
model on the run's first batch to plan candidate schemes, and the compile child then
compiles the chosen scheme, which imports the same model on the same batch again.
Inside ``with reused_imports() as memo:`` ``import_torch`` returns the import it made
before for the same

- model object, loss function and ``forward_only``;
- parameter and buffer tensors (name, storage address, shape, dtype; a weight replaced
  by a stand-in, as the compile child does for GGUF blocks, is another state);
- train/eval mode of every module, and the modules exported in eval mode;
- example batch (shape, dtype and a digest of its bytes: another tensor with the same
  values is the same batch).

An import is only read by what follows it (``apply_resolution`` and the passes build new
graphs, the step binds a new dict of values), so a reused one gives the same step, bit
for bit. ``memo.keep(rows)`` drops the imports of other batch sizes (the analysis'
micro-batches) once they are no longer needed. Outside the context nothing is kept.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pockengine.frontend.imported import ImportedModel

__all__ = ["ImportMemo", "reused_imports"]


class _Key(NamedTuple):
    model: int
    loss_fn: int
    forward_only: bool
    state: tuple[tuple[str, int, tuple[int, ...], str], ...]
    modes: tuple[bool, ...]
    eval_modules: frozenset[str]
    batch: tuple[tuple[tuple[int, ...], str, str], ...]

    @property
    def rows(self) -> int | None:
        return self.batch[0][0][0] if self.batch and self.batch[0][0] else None


@dataclass
class ImportMemo:
    """The imports made inside one ``reused_imports`` context, and how many were reused."""

    imports: dict[_Key, ImportedModel] = field(default_factory=dict)
    reused: int = 0

    def keep(self, rows: int) -> None:
        """Forget every import whose batch has other than ``rows`` examples."""
        for key in [k for k in self.imports if k.rows != rows]:
            del self.imports[key]


_MEMO: contextvars.ContextVar[ImportMemo | None] = contextvars.ContextVar(
    "import_memo", default=None
)


@contextlib.contextmanager
def reused_imports() -> Iterator[ImportMemo]:
    """Inside, an import of a model state, batch and mode made before is returned again."""
    memo = ImportMemo()
    token = _MEMO.set(memo)
    try:
        yield memo
    finally:
        _MEMO.reset(token)
        memo.imports.clear()


def key_of(
    model: Any,
    loss_fn: Any,
    batch: Sequence[Any],
    eval_modules: Iterable[str],
    forward_only: bool,
) -> _Key | None:
    """The memo's key for an import (None: no memo is active, or a batch tensor whose bytes
    cannot be read)."""
    if _MEMO.get() is None:
        return None
    tensors = itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    state = tuple((n, t.data_ptr(), tuple(t.shape), str(t.dtype)) for n, t in tensors)
    try:
        data = tuple((tuple(t.shape), str(t.dtype), _digest(t)) for t in batch)
    except (TypeError, RuntimeError):
        return None
    modes = tuple(m.training for m in model.modules())
    return _Key(id(model), id(loss_fn), forward_only, state, modes, frozenset(eval_modules), data)


def _digest(tensor: Any) -> str:
    data = tensor.detach().cpu().contiguous().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def recall(key: _Key | None) -> ImportedModel | None:
    memo = _MEMO.get()
    if key is None or memo is None or key not in memo.imports:
        return None
    memo.reused += 1
    return memo.imports[key]


def remember(key: _Key | None, imported: ImportedModel) -> None:
    memo = _MEMO.get()
    if key is not None and memo is not None:
        memo.imports[key] = imported
