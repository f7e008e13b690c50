#!/usr/bin/env bash
# The README's main command on a fresh virtualenv: its install steps exactly as written in
# the README (read from it, so the two cannot drift), then its job for a few steps, then
# the README's after-the-run commands (evaluate, predict, pe.load_run) on its folder.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
install=$(python .ci/readme_commands.py main-install)
job=$(python .ci/readme_commands.py main-job)
echo "main job, fresh venv: $install"
python -m venv "$work/venv"
# shellcheck disable=SC1091
source "$work/venv/bin/activate"
start=$SECONDS
bash -euo pipefail -c "$install" > "$work/install.log" 2>&1 || { tail -40 "$work/install.log"; exit 1; }
echo "installed in $((SECONDS - start)) s; running: $job --max-steps 3 --max-val 32"
start=$SECONDS
# in $work, where it writes the folder it names by default (the README's commands read it)
(cd "$work" && bash -euo pipefail -c "$job --max-steps 3 --max-val 32")
echo "main job ran 3 steps in $((SECONDS - start)) s"
# The README's after-the-run commands, as written, on the folder the job wrote: each must
# exit 0.
after=$(python .ci/readme_commands.py after-run)
for command in evaluate predict load_run; do
    grep -q "$command" <<< "$after" || { echo "README: no after-the-run $command command"; exit 1; }
done
while IFS= read -r command; do
    echo "after the run: $command"
    (cd "$work" && bash -euo pipefail -c "$command") > "$work/after.log" 2>&1 \
        || { tail -20 "$work/after.log"; echo "failed: $command"; exit 1; }
    tail -3 "$work/after.log"
done <<< "$after"
