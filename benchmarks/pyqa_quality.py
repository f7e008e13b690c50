"""The smollm2-pyqa quality table: full, LoRA, sparse and auto on Python-docs question/answer
pairs, scored on the held-out test split's answers.

    python benchmarks/pyqa_quality.py --schemes full lora sparse auto

Each scheme is one ``pockengine finetune --recipe smollm2-pyqa --scheme S --threads T`` run
in its own process, ``--parallel`` of them at once (the recipe's defaults: 1 epoch of 4 rows
x 256 tokens over 192 training pairs, the best validation epoch kept); reported: the
held-out test loss and perplexity over the answer tokens (the run's own final test metric),
the trained parameters, the mean step time, the step's planned peak and the training
process's peak RSS. While the first runs train, the untrained model's test loss is computed
the same way (eager torch, ``lm_pack.packed_lm_eval`` over the same packed test rows); for
the first ``--prompts`` test questions, the greedy answer (``--max-new-tokens``) of the
untrained model and of each fine-tuned ``RUN/model``, with the model's chat template.
Writes benchmarks/results/pyqa_quality.json (``--tag T``: pyqa_quality-T.json) after every
run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _harness import ROOT, utc_now, write_results

from pockengine.tasks import causal_lm, instruct_data, lm_pack, recipes
from pockengine.tasks.config import FinetuneConfig

_SCRIPT = "python benchmarks/pyqa_quality.py"


def _config(args: argparse.Namespace) -> FinetuneConfig:
    config = FinetuneConfig(recipe="smollm2-pyqa", seed=args.seed)
    return config.with_defaults(recipes.defaults(config)).validate()


def _test_loss(model: Any, tokenizer: Any, config: FinetuneConfig) -> dict[str, float]:
    """Mean loss over the held-out answers' tokens (eager torch, the run's packed rows)."""
    from pockengine.tasks.instruct_task import pyqa_task

    task = pyqa_task(config, causal_lm.pydocs_files(), model, tokenizer)
    total = torch.zeros(2)
    model.eval()
    with torch.no_grad():
        for start in range(0, len(task.test[0]), 8):
            rows = recipes.tensor_rows(task.test, start, start + 8)
            total += lm_pack.packed_lm_eval(model, *rows, torch.ones(len(rows[0])))
    loss = float(total[0] / total[1])
    return {"test_loss": loss, "test_perplexity": float(torch.exp(torch.tensor(loss)))}


def _generate(model: Any, tokenizer: Any, questions: list[str], n: int) -> list[str]:
    out = []
    model.eval()
    for q in questions:
        turn = [{"role": "user", "content": q}]
        text = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=n, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)  # fmt: skip
        out.append(tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True).strip())
    return out


def _load(folder: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                 use_safetensors=True)  # fmt: skip
    return model, AutoTokenizer.from_pretrained(str(folder))


def _start(scheme: str, out: Path, args: argparse.Namespace) -> tuple[list[str], Any, float]:
    command = [sys.executable, "-m", "pockengine", "finetune", "--recipe", "smollm2-pyqa",
               "--scheme", scheme, "--out", str(out), "--force", "--progress", "none",
               "--seed", str(args.seed), "--threads", str(args.threads)]  # fmt: skip
    done = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    return command, done, time.perf_counter()


def _finish(scheme: str, out: Path, started: tuple[list[str], Any, float]) -> dict[str, Any]:
    command, process, start = started
    _, err = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{err[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "scheme": scheme, "command": " ".join(["pockengine", *command[3:]]),
        "wall_s": time.perf_counter() - start, "steps": summary["steps"],
        "trained_params": summary["trained_params"], "step_s": summary["step_s"],
        "planned_peak_bytes": summary["planned_peak_bytes"],
        "peak_rss_bytes": summary["peak_rss_bytes"], "val_loss": summary["final"]["val_loss"],
        **summary["test"], "auto_scheme": (summary.get("auto_scheme") or {}).get("name"),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schemes", nargs="+", default=["full", "lora", "sparse", "auto"])
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    p.add_argument("--parallel", type=int, default=2, help="runs at once")
    p.add_argument(
        "--no-before",
        dest="before",
        action="store_false",
        help="leave out the untrained model (another results file has it)",
    )
    p.add_argument("--tag", help="write pyqa_quality-TAG.json")
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "pyqa-quality")
    args = p.parse_args()
    config = _config(args)
    torch.set_num_threads(args.threads)
    pairs = instruct_data.split_pairs(instruct_data.pydocs_pairs(causal_lm.pydocs_files()))[2]
    pairs = pairs[: args.prompts]
    questions = [instruct_data.question(q.name) for q in pairs]
    every, n = args.schemes, args.parallel
    waves = [every[i : i + n] for i in range(0, len(every), n)]
    started = {s: _start(s, args.runs / s, args) for s in waves[0]}  # the untrained one meanwhile
    results: dict[str, Any] = {
        "when": utc_now(), "command": " ".join([_SCRIPT, *sys.argv[1:]]),
        "args": {k: str(v) for k, v in vars(args).items()},
        "threads": args.threads, "config": config.training_dict(),
        "prompts": [{"question": q, "reference": r.answer}
                    for q, r in zip(questions, pairs, strict=True)],
        "rows": [],
    }  # fmt: skip
    if args.before:
        base, tokenizer = _load(causal_lm.smollm2_folder())
        results["before"] = {**_test_loss(base, tokenizer, config),
                             "generations": _generate(base, tokenizer, questions,
                                                      args.max_new_tokens)}  # fmt: skip
        print(json.dumps(results["before"], indent=1), flush=True)
        del base
    for i, schemes in enumerate(waves):
        if i:
            started = {s: _start(s, args.runs / s, args) for s in schemes}
        for scheme in schemes:
            row = _finish(scheme, args.runs / scheme, started[scheme])
            model, tok = _load(args.runs / scheme / "model")
            row["generations"] = _generate(model, tok, questions, args.max_new_tokens)
            results["rows"].append(row)
            print(json.dumps(row, indent=1), flush=True)
            write_results("pyqa_quality" + (f"-{args.tag}" if args.tag else ""), results)


if __name__ == "__main__":
    main()
