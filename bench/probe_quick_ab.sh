#!/bin/bash
# `vpscluster probe --quick` of this tree against another revision's, side by side (ABBA) on one
# 3-node sandbox at 100 Mbit/s: the wall time of each probe and the mean link bandwidth it read.
#   bash bench/probe_quick_ab.sh [REV]      (root; default REV: 3f0f7c0, before the shorter link tests)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rev=${1:-3f0f7c0}
py=${PY:-$root/.venv/bin/python}
name=${SANDBOX_NAME:-pqab$$}
tree=$(mktemp -d /tmp/vpsc-probe-ab-XXXX)
git -C "$root" worktree add -q --detach "$tree/old" "$rev"
vpsc() { PYTHONPATH=$1/src "$py" -m vpscluster "${@:2}"; }
trap 'vpsc "$root" sandbox down --name "$name" >/dev/null 2>&1 || true; git -C "$root" worktree remove --force "$tree/old"; rm -rf "$tree"' EXIT
vpsc "$root" sandbox up --name "$name" --nodes 3 --bandwidth 100mbit --json > "$tree/up.json"
cluster=$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["cluster_file"])' "$tree/up.json")
for which in new old old new; do
  src=$root; [ "$which" = old ] && src=$tree/old
  t0=$(date +%s.%N)
  vpsc "$src" probe --cluster "$cluster" --quick --json > "$tree/$which.json" || true
  t1=$(date +%s.%N)
  "$py" - "$tree/$which.json" "$which" "$t0" "$t1" <<'PY'
import json, statistics, sys
doc = json.load(open(sys.argv[1]))
bw = [l["bandwidth_mbit"] for l in doc.get("links", []) if l.get("bandwidth_mbit")]
print(f"{sys.argv[2]}: {float(sys.argv[4]) - float(sys.argv[3]):.1f} s, {len(bw)} links, "
      f"mean {statistics.mean(bw) if bw else 0:.1f} Mbit/s (min {min(bw, default=0):.1f}, max {max(bw, default=0):.1f})")
PY
done
