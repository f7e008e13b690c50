"""``pockengine evaluate | predict | generate``: use a finished (or stopped) run's model.

Each reads ``RUN/model`` (``pe.load_run``), which ``pockengine finetune`` writes when a run
ends or stops. ``predict`` and ``generate`` need nothing else; ``evaluate`` rebuilds the
run's validation split from its recipe and data unless ``--data`` names a file.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import io
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from pockengine.finetune.arg_types import non_negative_float, positive_int
from pockengine.finetune.run_folder.run_files import RunFileError, shown

__all__ = ["FACTORY_HELP", "register"]


_RUN_HELP = "a run folder of pockengine finetune"
FACTORY_HELP = (
    "for a run of a module:factory model: the factory to rebuild it with, the one the run "
    "trained (a run folder never names code to run; the factory it records must match)"
)


def register(sub: Any) -> None:
    """Add ``evaluate``, ``predict`` and ``generate`` to the ``pockengine`` subcommands."""
    for add in (_add_evaluate, _add_predict, _add_generate):
        parser = add(sub)
        parser.add_argument("--threads", type=positive_int, help="torch threads (default: torch's)")


def _run_parser(
    sub: Any,
    name: str,
    command: Callable[[argparse.Namespace], int],
    help: str,
    run_help: str = _RUN_HELP,
) -> Any:
    """The subcommand ``name`` on a run folder (its first argument, RUN), running
    ``command`` under the ``--threads`` that ``register`` adds last."""
    parser = sub.add_parser(name, help=help)
    parser.add_argument("run_dir", metavar="RUN", help=run_help)
    parser.add_argument("--factory", metavar="MODULE:NAME", help=FACTORY_HELP)
    parser.set_defaults(run=_with_threads, run_command=command)
    return parser


def _add_evaluate(sub: Any) -> Any:
    ev = _run_parser(
        sub,
        "evaluate",
        _evaluate,
        help="accuracy, macro-F1, per-class scores and confusion (perplexity for a causal "
        "LM) of a run's model; writes RUN/eval.json and RUN/confusion.png",
    )
    ev.add_argument(
        "--data",
        help="a .csv/.tsv/.jsonl file or class folder in the run's "
        "columns (a text file or folder for a causal LM); default: the run's "
        "validation split",
    )
    return ev


def _add_predict(sub: Any) -> Any:
    pr = _run_parser(
        sub,
        "predict",
        _predict,
        help="classify texts with a run's model: one JSON line per input "
        '({"label": ..., "probs": {...}})',
    )
    pr.add_argument(
        "texts", nargs="*", metavar="TEXT", help="texts (image files for a vision run) to classify"
    )
    pr.add_argument(
        "--input",
        help="a file of inputs: .jsonl/.csv/.tsv (the run's text "
        "column) or plain text, one input a line",
    )
    pr.add_argument("--output", help="write the JSON lines here instead of to stdout")
    pr.add_argument("--batch-size", type=positive_int, default=32, help="inputs a forward pass")
    return pr


def _add_generate(sub: Any) -> Any:
    ge = _run_parser(
        sub,
        "generate",
        _generate,
        help="continue a prompt with a causal-LM run's model, streaming the "
        "text; reports tokens per second",
        run_help=f"{_RUN_HELP} (a causal LM)",
    )
    ge.add_argument("--prompt", help="the text to continue (required without --chat)")
    ge.add_argument(
        "--chat",
        action="store_true",
        help="chat: each line of stdin a user turn, rendered with the run's chat "
        "template; the model replies after each",
    )
    ge.add_argument("--system", help="with --chat: a system turn first")
    ge.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=100,
        help="stop after this many tokens (or earlier, where the prompt and the new tokens "
        "fill the model's context: its configured positions)",
    )
    ge.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.8,
        help="softmax temperature; 0 picks the most likely token",
    )
    ge.add_argument("--top-k", type=positive_int, default=50, help="sample among the K likeliest")
    ge.add_argument(
        "--seed", type=int, default=0, help="of the sampling; the same seed, the same text"
    )
    return ge


def _with_threads(args: argparse.Namespace) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    command: Callable[[argparse.Namespace], int] = args.run_command
    return command(args)


def _evaluate(args: argparse.Namespace) -> int:
    from pockengine.finetune.run_folder.home_load import load_run
    from pockengine.finetune.trained.run_eval import evaluate_run, format_eval, write_eval

    result = evaluate_run(load_run(args.run_dir, args.factory), args.data)
    print(format_eval(result))
    written, notes = write_eval(Path(args.run_dir), result)
    print(f"wrote {', '.join(str(p) for p in written)}")
    for note in notes:
        print(f"note: {note}")
    return 0


def _predict(args: argparse.Namespace) -> int:
    from pockengine.finetune.run_folder.home_load import as_prediction, load_run

    if bool(args.texts) == bool(args.input):
        raise ValueError("predict takes texts or --input FILE (one of them)")
    loaded = load_run(args.run_dir, args.factory)
    column = str(loaded.meta.get("config", {}).get("text_column") or "text")
    inputs = _read_inputs(Path(args.input), column) if args.input else list(args.texts)
    with _bar(len(inputs) if args.input else 0) as advance, _sink(args.output) as out:
        for start in range(0, len(inputs), args.batch_size):
            chunk = inputs[start : start + args.batch_size]
            for row in loaded.predict_proba(chunk, args.batch_size):
                out.write(json.dumps(as_prediction(row, loaded.labels)) + "\n")
            advance(len(chunk))
    if args.output:
        print(f"wrote {len(inputs)} predictions to {args.output}", file=sys.stderr)
    return 0


def _read_inputs(path: Path, column: str) -> list[str]:
    """The inputs in a file: a .jsonl/.csv/.tsv text column, or one input a line; a
    ``RunFileError`` naming the file (and the line) when one cannot be read."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RunFileError(f"{path}: cannot read the inputs: {exc}") from exc
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return [
            _field(_json_line(line, path, i), column, path, i)
            for i, line in enumerate(text.splitlines(), 1)
            if line.strip()
        ]
    if suffix in (".csv", ".tsv"):
        rows = csv.DictReader(
            io.StringIO(text, newline=""), delimiter="\t" if suffix == ".tsv" else ","
        )
        try:
            return [_field(row, column, path, rows.line_num) for row in rows]
        except csv.Error as exc:
            raise RunFileError(f"{path}:{rows.line_num}: not a {suffix[1:]} line: {exc}") from exc
    return [line for line in text.splitlines() if line.strip()]


def _json_line(line: str, path: Path, number: int) -> Any:
    try:
        return json.loads(line)
    except ValueError as exc:
        raise RunFileError(f"{path}:{number}: not a JSON line: {exc}") from exc


def _field(row: Any, column: str, path: Path, line: int) -> str:
    if not isinstance(row, dict) or column not in row:
        raise RunFileError(f"{path}:{line}: no {column!r} field (the run's text column)")
    value = row[column]
    if not isinstance(value, str):
        raise RunFileError(f"{path}:{line}: {column!r} is {shown(value)}, not a text")
    return value


@contextmanager
def _sink(path: str | None) -> Iterator[IO[str]]:
    if path is None:
        yield sys.stdout
        return
    with open(path, "w", encoding="utf-8") as f:
        yield f


@contextmanager
def _bar(total: int) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr for ``total`` inputs (none when 0 or tqdm is missing)."""
    try:
        tqdm: Any = importlib.import_module("tqdm").tqdm  # optional, untyped
    except ImportError:
        total = 0
    if not total:
        yield lambda n: None
        return
    with tqdm(total=total, unit="input", file=sys.stderr, dynamic_ncols=True) as bar:
        yield bar.update


def _chat(loaded: Any, args: argparse.Namespace) -> int:
    from pockengine.finetune.trained.lm_chat import chat

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                "top_k": args.top_k, "seed": args.seed}  # fmt: skip
    replies = chat(loaded, sys.stdin, show, system=args.system, **sampling)
    tokens, seconds = sum(r.tokens for r in replies), sum(r.seconds for r in replies)
    rate = tokens / seconds if seconds > 0 else 0.0
    print(
        f"{len(replies)} replies, {tokens} tokens in {seconds:.2f} s ({rate:.1f} tokens/s)",
        file=sys.stderr,
    )
    return 0


def _generate(args: argparse.Namespace) -> int:
    from pockengine.finetune.run_folder.home_load import load_run
    from pockengine.finetune.trained.generation import check_generation, generate, prompt_ids
    from pockengine.tasks.config import FinetuneError

    loaded = load_run(args.run_dir, args.factory)
    check_generation(loaded, args.max_new_tokens, args.temperature, args.top_k)
    if args.chat:
        return _chat(loaded, args)
    if args.prompt is None:
        raise FinetuneError("generate needs --prompt TEXT, or --chat (user turns on stdin)")
    prompt_ids(loaded, args.prompt)  # an empty or too long prompt: before it is echoed
    sys.stdout.write(args.prompt)
    sys.stdout.flush()

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    done = generate(
        loaded,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        on_text=show,
    )
    print()
    if done.context is not None:
        print(
            f"note: stopped at the model's context of {done.context} positions "
            f"({done.prompt_tokens} prompt + {done.tokens} new tokens), before "
            f"--max-new-tokens {args.max_new_tokens}",
            file=sys.stderr,
        )
    print(
        f"{done.tokens} tokens in {done.seconds:.2f} s ({done.tokens_per_s:.1f} tokens/s)",
        file=sys.stderr,
    )
    return 0
