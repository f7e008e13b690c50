"""Print a command of the README's opening, for CI to run exactly as users read it.

The README starts with two fenced ``bash`` blocks: the main job (install + ``pockengine
finetune``) and the tests. ``python .ci/readme_commands.py main-install`` prints the main
command's install steps (every ``&&``-joined step before the first ``pockengine`` one);
``main-job`` prints its ``pockengine`` steps; ``tests`` prints the whole test command.
``after-run`` prints, one a line, the README's after-the-run commands on the main job's
folder: the lines of the first later ``bash`` block that runs ``pockengine evaluate``,
less ``pockengine generate`` (it needs a causal-LM run, which the main job is not).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_BLOCK = re.compile(r"```bash\n(.*?)```", re.DOTALL)


def _commands(readme: Path) -> list[str]:
    blocks = [b.strip() for b in _BLOCK.findall(readme.read_text(encoding="utf-8"))]
    if len(blocks) < 2 or any("\n" in b for b in blocks[:2]):
        sys.exit(f"{readme}: expected two one-line ```bash blocks at the top")
    return blocks[:2]


def _after_run(readme: Path) -> list[str]:
    blocks = _BLOCK.findall(readme.read_text(encoding="utf-8"))[2:]
    block = next((b for b in blocks if "pockengine evaluate" in b), None)
    if block is None:
        sys.exit(f"{readme}: no ```bash block of after-the-run commands (pockengine evaluate)")
    lines = [line.strip() for line in block.splitlines() if line.strip()]
    return [line for line in lines if not line.startswith("pockengine generate")]


def main(which: str) -> None:
    readme = Path(__file__).resolve().parent.parent / "README.md"
    if which == "after-run":
        print("\n".join(_after_run(readme)))
        return
    main_cmd, test_cmd = _commands(readme)
    steps = [s.strip() for s in main_cmd.split("&&")]
    first_job = next((i for i, s in enumerate(steps) if s.startswith("pockengine")), None)
    if first_job is None:
        sys.exit("README: the main command runs no `pockengine` step")
    chosen = {
        "main-install": steps[:first_job],
        "main-job": steps[first_job:],
        "tests": [test_cmd],
    }[which]
    print(" && ".join(chosen))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "main-install")
