#!/bin/bash
# The built-in GPT's tokens/s through the session API against the trainer before it moved onto
# the session (commit 1a3f33e^1), side by side in one run, ABBA: `bash bench/session_ab.sh [BEFORE]`.
# Needs the project's .venv; the "before" tree is a temporary git worktree, removed at the end.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
before=${1:-1a3f33e^1}
py=$root/.venv/bin/python
tree=$(mktemp -d /tmp/vpsc-session-ab-XXXX)
run=$tree/run
git -C "$root" worktree add -q --detach "$tree/before" "$before"
trap 'git -C "$root" worktree remove --force "$tree/before"; rm -rf "$tree"' EXIT
for which in after before before after; do
  if [ "$which" = after ]; then src=$root/src; else src=$tree/before/src; fi
  rm -rf "$run"
  (cd "$tree" && PYTHONPATH=$src timeout 600 "$py" -m vpscluster train --nodes 2 --max-steps 150 --eval-every 1000 \
      --checkpoint-every 1000 --run-dir "$run" --json 2>/dev/null) | "$py" -c "import json,sys; r=json.load(sys.stdin); \
print('$which', round(r['tokens_per_s']), 'tokens/s; utilisation', round(r['compute_utilization'], 3), '; final loss', \
round(r['final_train_loss'], 3), '; wall', round(r['wall_seconds'], 1), 's')"
done
