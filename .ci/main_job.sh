#!/usr/bin/env bash
# The README's main command on a fresh virtualenv: its install steps exactly as written in
# the README (read from it, so the two cannot drift), then its job for a few steps.
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
(cd "$work" && bash -euo pipefail -c "$job --max-steps 3 --max-val 32 --out $work/run")
test -s "$work/run/summary.json" || test -s "$work/run/checkpoint.safetensors"
echo "main job ran 3 steps in $((SECONDS - start)) s"
