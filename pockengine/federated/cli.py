"""``pockengine federated``: its options, the run, the summary and the plot.

The options are the federation's plus those of ``pockengine finetune`` that apply to
every client's local training (recipe or model and data, scheme, optimizer, learning
rate, batch shape, data subset, seed, backend). ``--out DIR`` receives ``rounds.jsonl``,
``summary.json``, ``global.safetensors`` and ``rounds.png``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from pockengine.cli_help import BACKEND_HELP
from pockengine.federated.config import FederatedConfig, FederatedError
from pockengine.federated.local_loss import LOCAL_LOSSES
from pockengine.federated.server_step import SERVER_OPTIMIZERS
from pockengine.finetune.arg_types import byte_amount, positive_int
from pockengine.out_folder import FEDERATION, claim, release
from pockengine.safe_write import write_with
from pockengine.sparse.schemes import SCHEME_HELP
from pockengine.tasks.config import AUTO_SCORES, DEFAULT_BACKEND, DEFAULT_RECIPE, FinetuneConfig

__all__ = ["add_arguments", "config_from_args", "plot_rounds", "run", "summary_text"]

_FINETUNE_OPTIONS = (
    "recipe", "model", "data", "text_column", "label_column", "tokenizer", "scheme",
    "optimizer", "lr", "weight_decay", "momentum", "batch_size", "seq_len", "image_size",
    "warmup", "val_fraction", "max_train", "max_val", "dedupe", "seed", "backend", "out",
    "memory_budget", "auto_score", "force",
)  # fmt: skip
# What a federation writes at the top of its folder (a folder from before the marker holds
# only these, and its global state).
_FEDERATION_FILES = frozenset(
    {"rounds.jsonl", "summary.json", "global.safetensors", "rounds.png", "deployment-logs"}
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    fed = p.add_argument_group("federation")
    fed.add_argument("--clients", type=int, default=2, help="client processes (shards)")
    fed.add_argument("--rounds", type=int, default=3, help="rounds of local training and averaging")
    fed.add_argument("--local-epochs", type=int, default=1, help="epochs a client runs a round")
    fed.add_argument(
        "--partition",
        choices=("iid", "dirichlet"),
        default="iid",
        help="how the training split is dealt to the clients",
    )
    fed.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration")
    fed.add_argument("--proximal-mu", type=float, default=0.0, help="FedProx (0: FedAvg)")
    fed.add_argument(
        "--server-optimizer",
        choices=SERVER_OPTIMIZERS,
        default="avg",
        help="the server's optimizer over the averaged update: FedAvg, FedAvgM, "
        "FedAdam, FedYogi, FedAdagrad (Reddi et al. 2021)",
    )
    fed.add_argument(
        "--server-lr",
        type=float,
        help="the server's learning rate (default 1 for avg/avgm: FedAvg's "
        "step; 0.01 for adam/yogi/adagrad)",
    )
    fed.add_argument(
        "--server-momentum",
        type=float,
        default=0.0,
        help="FedAvgM: momentum of the server's step (0: FedAvg)",
    )
    fed.add_argument(
        "--server-betas",
        type=float,
        nargs=2,
        default=(0.9, 0.99),
        metavar=("B1", "B2"),
        help="adam/yogi/adagrad: moment decays",
    )
    fed.add_argument(
        "--server-tau",
        type=float,
        default=1e-3,
        help="adam/yogi/adagrad: tau, the adaptivity (epsilon)",
    )
    fed.add_argument(
        "--bn-statistics",
        choices=("recompute", "running"),
        default="recompute",
        help="BatchNorm statistics a client sends: those of its shard under its "
        "final weights, or the step's running ones",
    )
    fed.add_argument(
        "--local-loss",
        choices=LOCAL_LOSSES,
        default="plain",
        help="the clients' loss: the task's, or logit-adjusted against label "
        "skew (logits plus tau times the client's log label prior)",
    )
    fed.add_argument(
        "--la-tau",
        type=float,
        default=1.0,
        help="logit-adjusted: tau, the log prior's weight (0: plain)",
    )
    fed.add_argument("--timeout", type=float, default=600.0, help="seconds a round waits")
    fed.add_argument("--threads", type=int, default=1, help="torch threads per client")
    fed.add_argument(
        "--parallel",
        type=positive_int,
        metavar="N",
        help="at most N client processes at once (default: the cores, "
        f"{os.cpu_count()} here); a process hosts several clients beyond that, "
        "one after another, sharing one compiled step; --deployment needs "
        "--clients <= N",
    )
    fed.add_argument("--resume", action="store_true", help="continue from --out's state")
    fed.add_argument("--stop-after-round", type=int, help="stop the server there (for --resume)")
    fed.add_argument(
        "--fail",
        nargs="*",
        default=[],
        metavar="CLIENT:ROUND",
        help="make a client's training raise in a round (faults)",
    )
    fed.add_argument(
        "--delay",
        nargs="*",
        default=[],
        metavar="CLIENT:ROUND:SECONDS",
        help="make a client sleep before training in a round",
    )
    fed.add_argument(
        "--deployment",
        action="store_true",
        help="run under Flower's deployment engine: a SuperLink and N SuperNodes "
        "on 127.0.0.1, started and stopped by the command",
    )
    what = p.add_argument_group("local training (as pockengine finetune; defaults: the recipe's)")
    what.add_argument("--recipe", help=f"a built-in recipe (default {DEFAULT_RECIPE})")
    what.add_argument("--model", help="a Hugging Face model folder, or module:factory")
    what.add_argument("--data", help="a .csv/.tsv/.jsonl file or a folder of class subfolders")
    what.add_argument("--text-column", default="text", help="the --data column or key of the text")
    what.add_argument("--label-column", default="label", help="the --data column of the label")
    what.add_argument("--tokenizer", help="a Hugging Face tokenizer folder for a factory model")
    what.add_argument("--scheme", help=f"what trains: {SCHEME_HELP} (default: the recipe's)")
    what.add_argument(
        "--memory-budget",
        type=byte_amount,
        help="--scheme auto: the planned peak of a client's step, e.g. 300MB "
        "(default: the sparse scheme's)",
    )
    what.add_argument(
        "--auto-score",
        choices=AUTO_SCORES,
        default="fisher",
        help="--scheme auto: what ranks the weights (as pockengine finetune)",
    )
    what.add_argument(
        "--upload-budget",
        type=float,
        help="--scheme auto: the most a client sends a round, as a fraction of "
        "full-model FedAvg's bytes, e.g. 0.2 (default: no limit)",
    )
    what.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="optimizer")
    what.add_argument("--lr", type=float, help="peak learning rate (default: by scheme)")
    what.add_argument("--weight-decay", type=float, default=0.01, help="AdamW or SGD decay")
    what.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    what.add_argument("--batch-size", type=int, help="examples a step (default: the recipe's)")
    what.add_argument("--seq-len", type=int, help="tokens per example")
    what.add_argument("--image-size", type=int, help="image side in pixels")
    what.add_argument("--warmup", type=float, default=0.1, help="warmup fraction of all steps")
    what.add_argument("--val-fraction", type=float, default=0.2, help="held out for central eval")
    what.add_argument("--max-train", type=int, help="at most N training examples in all")
    what.add_argument("--max-val", type=int, help="at most N held-out examples (central eval)")
    what.add_argument(
        "--no-dedupe", dest="dedupe", action="store_false", help="keep exact duplicate texts"
    )
    what.add_argument("--seed", type=int, default=0, help="the split, the shards, the order")
    what.add_argument("--backend", default=DEFAULT_BACKEND, help=BACKEND_HELP)
    what.add_argument("--out", help="output folder (default runs/federated-<recipe>)")
    what.add_argument(
        "--force",
        action="store_true",
        help="write into --out even if it is not new, empty or a federation of pockengine: "
        "only the files a federation writes are replaced there, nothing else is deleted",
    )


def config_from_args(args: argparse.Namespace) -> FederatedConfig:
    values = {name: getattr(args, name) for name in _FINETUNE_OPTIONS}
    if values["recipe"] is None and values["model"] is None and values["data"] is None:
        values["recipe"] = DEFAULT_RECIPE
    ft = FinetuneConfig(**values)
    return FederatedConfig(
        finetune=ft,
        clients=args.clients,
        rounds=args.rounds,
        local_epochs=args.local_epochs,
        partition=args.partition,
        alpha=args.alpha,
        proximal_mu=args.proximal_mu,
        upload_budget=args.upload_budget,
        server_optimizer=args.server_optimizer,
        server_lr=args.server_lr,
        server_momentum=args.server_momentum,
        server_betas=tuple(args.server_betas),
        server_tau=args.server_tau,
        bn_statistics=args.bn_statistics,
        local_loss=args.local_loss,
        la_tau=args.la_tau,
        timeout=args.timeout,
        resume=args.resume,
        threads=args.threads,
        parallel=args.parallel,
        stop_after_round=args.stop_after_round,
        fail=tuple(args.fail),
        delay=tuple(args.delay),
    )


def run(config: FederatedConfig, deployment: bool = False) -> dict[str, Any]:
    """Simulate the run (or deploy it: ``deployment``), write its plot; the summary
    (``summary.json``'s contents)."""
    try:
        from pockengine.federated.deployment import deploy
        from pockengine.federated.engine import simulate
    except ImportError as exc:
        raise FederatedError(
            f"pockengine federated needs Flower ({exc}): pip install 'pockengine[federated]'"
        ) from exc
    from pockengine.federated.server import ROUNDS, out_dir

    out = out_dir(config)
    taken = claim(out, FEDERATION, force=config.finetune.force, legacy=_federation_before_marker)
    try:
        summary = deploy(config) if deployment else simulate(config)
    except BaseException:
        release(taken)  # a folder this run made and wrote nothing in is removed
        raise
    rows = [json.loads(line) for line in (out / ROUNDS).read_text().splitlines() if line]
    try:
        summary["plot"] = str(plot_rounds(rows, out / "rounds.png", summary["initial"]))
    except ImportError:
        summary["plot"] = None  # matplotlib is an extra: pip install 'pockengine[plot]'
    return summary


def _federation_before_marker(out: Path) -> bool:
    """A federation folder written before folders were marked."""
    names = {p.name for p in out.iterdir() if not p.name.startswith(".")}
    return names <= _FEDERATION_FILES and (out / "global.safetensors").is_file()


def plot_rounds(
    rows: list[dict[str, Any]], path: Path, initial: dict[str, float] | None = None
) -> Path:
    """Accuracy (from round 0, the starting state), and bytes sent up (sparse vs
    full-model FedAvg), against the round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rounds = [r["round"] for r in rows]
    start = [(0, initial["accuracy"])] if initial and "accuracy" in initial else []
    points = start + [(r["round"], r["accuracy"]) for r in rows]
    fig, (acc, comm) = plt.subplots(1, 2, figsize=(10, 4))
    acc.plot([p[0] for p in points], [p[1] for p in points], marker="o")
    for axis in (acc, comm):
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    acc.set(xlabel="round", ylabel="central accuracy", title="accuracy")
    comm.plot(rounds, [r["bytes_up"] / 2**20 for r in rows], marker="o", label="sent up (sparse)")
    comm.plot(
        rounds, [r["bytes_full_model"] / 2**20 for r in rows], marker="x", label="full-model FedAvg"
    )
    comm.set(xlabel="round", ylabel="MiB per round", title="communication", yscale="log")
    comm.legend()
    fig.tight_layout()
    try:
        write_with(path, lambda f: fig.savefig(f, format="png", dpi=100))
    finally:
        plt.close(fig)
    return path


def summary_text(summary: dict[str, Any]) -> str:
    ratio = summary["up_ratio"]
    final, initial = summary["final"], summary["initial"]
    lines = [
        f"federated: {summary['rounds']} round(s) of {summary['config']['clients']} client(s)"
        f" in {summary['wall_s']:.1f}s",
        f"accuracy {initial.get('accuracy', float('nan')):.4f} -> {final['accuracy']:.4f}, "
        f"loss {initial.get('loss', float('nan')):.4f} -> {final['loss']:.4f} (central)",
        f"sent up {summary['bytes_up']} B, full-model FedAvg {summary['bytes_full_model']} B"
        + (f" ({100 * ratio:.2f}%)" if ratio is not None else ""),
        f"trained tensors: {len(summary['trained_tensors'])}",
    ]
    if choice := summary["config"].get("scheme_choice"):
        lines.append(f"--scheme auto chose, on client 0's shard: {_described(choice)}")
    if summary.get("plot"):
        lines.append(f"plot: {summary['plot']}")
    return "\n".join(lines)


def _described(choice: dict[str, Any]) -> str:
    """A scheme ``auto`` chose, in a few words."""
    if choice.get("scheme") != "select":
        return f"the {choice.get('scheme')} scheme"
    partial = choice.get("channels") or {}
    return (
        f"{len(choice.get('train', []))} trained tensor patterns, {len(partial)} of them in "
        "part (summary.json: config.scheme_choice)"
    )


_DESCRIPTION = """\
Federated sparse fine-tuning: a Flower simulation of N clients on this machine, in at most
--parallel client processes (default: the cores).
The options are the federation's plus those of pockengine finetune that apply to every
client's local training. --out receives rounds.jsonl, summary.json, global.safetensors
and rounds.png."""


def register(sub: Any) -> None:
    """Add ``pockengine federated`` to the command line's subparsers."""
    p = sub.add_parser(
        "federated",
        help="federated sparse fine-tuning: a Flower simulation of N clients on one machine",
        description=_DESCRIPTION,
    )
    add_arguments(p)
    p.set_defaults(run=_command)


def _command(args: argparse.Namespace) -> int:
    summary = run(config_from_args(args), deployment=args.deployment)
    print(summary_text(summary))
    return 0
