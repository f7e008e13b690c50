"""The compile child's memory, phase by phase (``pockengine finetune --compile-in child``).

    OMP_NUM_THREADS=1 python benchmarks/child_memory.py -- --recipe smollm2-pydocs \\
        --scheme sparse --frozen-dtype gguf --optimizer-state int8 --max-train 32 --max-val 16

Runs in this process what the child runs (``compile_child.compile_into``, on the job the
run would give it: the options after ``--``, defaults filled in as ``launch.run`` does)
and prints the resident memory and its peak (MiB) after each phase: imports, model +
tokenizer + data, (`--scheme auto`) the scheme chosen, the float copies of GGUF-given
weights released, step compiled,
evaluator compiled, artifact written. ``tree_memory.py`` measures the whole run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from _harness import vm_kib


def mem(label: str) -> None:
    rss, peak = vm_kib("VmRSS") // 1024, vm_kib("VmHWM") // 1024
    print(f"{time.strftime('%H:%M:%S')} {label}: RSS {rss} MiB, peak {peak} MiB", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("finetune_args", nargs=argparse.REMAINDER,
                        help="after --: pockengine finetune's options")  # fmt: skip
    options = parser.parse_args()
    mem("start")
    from pockengine.finetune.cli import add_arguments, config_from_args
    from pockengine.finetune.compiling import compile_child
    from pockengine.tasks import recipe_table

    mem("imports (no torch yet)")
    finetune = argparse.ArgumentParser(prog="pockengine finetune")
    add_arguments(finetune)
    args = finetune.parse_args([a for a in options.finetune_args if a != "--"])
    config = config_from_args(args).validate()
    config = config.with_defaults(recipe_table.defaults(config)).validate()
    assert config.scheme is not None, "filled in by the recipe's defaults"
    scheme = None  # auto: the child chooses it, then compiles it
    if config.scheme != "auto":
        scheme = recipe_table.parse_scheme(config.scheme, config.recipe, config.batchnorm).to_dict()
    job = {"config": config.to_dict(), "scheme": scheme, "threads": None}
    with tempfile.TemporaryDirectory(prefix="child-memory-") as folder:
        (Path(folder) / compile_child.JOB).write_text(json.dumps(job))
        compile_child.compile_into(Path(folder), mem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
