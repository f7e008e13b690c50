"""The one vocabulary of scheme names, shared by every command and the API.

``pockengine inspect``, ``finetune``, ``search`` and ``export`` and ``pe.schemes.named``
all turn a name into a scheme here, so each name trains the same parameters everywhere:

- ``full``: every parameter (``full()``).
- ``bias``: every bias and normalisation parameter, and the head: BitFit, with the head
  that a new task must train (``sparse(blocks=0)``).
- ``bias-only``: every bias and normalisation parameter, nothing else (``bias_only()``).
- ``sparse``: the model's sparse recipe: every bias and norm, the weights of the last 2
  blocks and the head (``sparse()``); a fine-tuning recipe or a benchmark workload may
  declare its own (the LLM recipe: norms and the output projections of every block).
- ``head``: the last linear layer (``head()``).
- ``last:K``: every parameter of the last K repeated blocks, and the head
  (``last_blocks(K)``).
- ``auto``: chosen by ``pockengine finetune`` from the model and the data (a gradient
  estimate, then the budgeted search: ``pockengine.scheme_choice.auto_scheme``); no command
  without the data can resolve it here.
- ``lora``, ``lora:R``: LoRA adapters of rank R (default 8, alpha 2R) on the attention
  query and value projections of the model family (``q_proj``/``v_proj``,
  ``query``/``value``, ...: ``pockengine.sparse.lora.DEFAULT_TARGETS``), and the head
  (``lora(R, 2R) | head()``): a classifier's head is new and must train. A recipe whose
  head is pretrained (the causal-LM recipe) trains the adapters alone (``lora_head=False``).

A path ending in ``.json``, ``.yaml`` or ``.yml`` is a scheme file (``schemes.load``).

BatchNorm layers that train nothing run on their running statistics under a named
scheme (``frozen_bn="eval"``, the default of every command): a short fine-tune barely
moves those statistics, and layers trained on batch statistics would meet different ones at
evaluation. ``frozen_bn="train"`` keeps batch statistics (the benchmark tables use it).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from pathlib import Path

from pockengine.ir import SchemeError
from pockengine.sparse import schemes
from pockengine.sparse.schemes import Scheme

__all__ = ["SCHEME_FILES", "SCHEME_HELP", "SCHEME_NAMES", "scheme_named"]

SCHEME_NAMES = {
    "full": "every parameter",
    "bias": "every bias and normalisation parameter, and the head",
    "bias-only": "every bias and normalisation parameter, nothing else",
    "sparse": "the model's sparse recipe (biases, norms, the last blocks' weights, the head)",
    "head": "the last linear layer",
    "last:K": "every parameter of the last K repeated blocks, and the head",
    "auto": "chosen by the fine-tuner: gradient estimate + search under --memory-budget",
    "lora:R": "LoRA adapters of rank R (default 8) on the attention q/v projections, the head",
}
SCHEME_FILES = (".json", ".yaml", ".yml")
SCHEME_HELP = f"{', '.join(SCHEME_NAMES)}, or a scheme file (see docs/sparse_backprop.md)"


def scheme_named(
    spec: str, *, sparse: Scheme | None = None, frozen_bn: str = "eval", lora_head: bool = True
) -> Scheme:
    """The scheme ``spec`` names (see the module's table), or the one a scheme file holds.

    ``sparse`` is what ``sparse`` means for this model (a recipe's or a workload's own;
    default ``schemes.sparse()``); ``frozen_bn`` applies to every named scheme, not to a
    file, which says its own; ``lora_head`` whether ``lora`` trains the head too.
    """
    if Path(spec).suffix in SCHEME_FILES:
        return schemes.load(spec)
    if spec == "lora" or spec.startswith("lora:"):
        return _lora(spec, _checked(frozen_bn), lora_head)
    if spec.startswith("last:"):
        k = spec.split(":", 1)[1]
        if not k.isdigit():
            raise SchemeError(f"scheme {spec!r}: last:K needs a whole number of blocks K")
        return schemes.last_blocks(int(k), frozen_bn=frozen_bn)
    if spec == "auto":
        raise SchemeError(
            "scheme 'auto' is chosen by pockengine finetune from the model and the data; "
            "here, give the scheme a run chose (its summary.json) or another name"
        )
    if spec == "sparse":
        return dataclasses.replace(sparse or schemes.sparse(), frozen_bn=_checked(frozen_bn))
    factories: dict[str, Callable[..., Scheme]] = {
        "full": schemes.full,
        "bias": lambda frozen_bn: schemes.sparse(blocks=0, frozen_bn=frozen_bn),
        "bias-only": schemes.bias_only,
        "head": schemes.head,
    }
    if spec not in factories:
        near = difflib.get_close_matches(spec, list(SCHEME_NAMES), n=1, cutoff=0.6)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        choices = f"a scheme file ({'/'.join(SCHEME_FILES)}) or one of {', '.join(SCHEME_NAMES)}"
        raise SchemeError(f"unknown scheme {spec!r}{hint}: {choices}")
    return factories[spec](frozen_bn=frozen_bn)


def _lora(spec: str, frozen_bn: str, head: bool) -> Scheme:
    rank = spec.split(":", 1)[1] if ":" in spec else "8"
    if not rank.isdigit() or int(rank) < 1:
        raise SchemeError(f"scheme {spec!r}: lora:R needs a whole rank R >= 1")
    lora = dataclasses.replace(schemes.lora(int(rank), 2 * int(rank)), frozen_bn=frozen_bn)
    return lora | schemes.head(frozen_bn=frozen_bn) if head else lora


def _checked(frozen_bn: str) -> str:
    if frozen_bn not in ("train", "eval"):
        raise SchemeError(f"frozen_bn must be 'train' or 'eval', got {frozen_bn!r}")
    return frozen_bn
