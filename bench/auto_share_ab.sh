#!/bin/bash
# `--strategy auto` on uneven nodes, balanced by default (issues 33, 36 item 4) against
# --no-balance, side by side: examples/image_classifier.py under `vpscluster run --strategy auto`
# on a sandbox of two nodes at 0.75 and 0.25 of a core, 1 Gbit/s, with an egress quota on every
# node that DDP's bytes would overrun (QUOTA, default 26GB/month: ~10 KB/s), so the rule switches
# to DiLoCo after the measured steps and the shares carry over. ABBA order (balanced, even, even,
# balanced).
#   bash bench/auto_share_ab.sh [SAMPLES] [BATCH]      (root; the sandbox is removed at the end)
# Prints each run's choice line, samples/s, steps, shares, bytes sent and whether the ranks'
# hashes agree, then the ratio of the means.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
samples=${1:-8192}
batch=${2:-128}
quota=${QUOTA:-26GB/month}
py=${PY:-$root/.venv/bin/python}
name=${SANDBOX_NAME:-autoshare-ab$$}
tree=$(mktemp -d /tmp/vpsc-autoshare-ab-XXXX)
vpsc() { PYTHONPATH=$root/src "$py" -m vpscluster "$@"; }
trap 'vpsc sandbox down --name "$name" >/dev/null 2>&1 || true; rm -rf "$tree"' EXIT
vpsc sandbox up --name "$name" --nodes 2 --bandwidth 1gbit --cpu 0.75,0.25 --json > "$tree/up.json"
cluster=$("$py" -c "import json,sys; print(json.load(open(sys.argv[1]))['cluster_file'])" "$tree/up.json")
"$py" - "$cluster" "$quota" <<'PY'
import sys, yaml
path, quota = sys.argv[1:]
doc = yaml.safe_load(open(path))
for node in doc["nodes"]:
    node["egress_quota"] = quota
open(path, "w").write(yaml.safe_dump(doc, sort_keys=False))
PY
for which in balanced even even balanced; do
  flag=(); [ "$which" = even ] && flag=(--no-balance)
  run=$tree/run-$which
  rm -rf "$run"
  timeout 900 env PYTHONPATH="$root/src" "$py" -m vpscluster run --cluster "$cluster" --run-dir "$run" \
      --strategy auto --sync "$root/examples" "${flag[@]}" -- python image_classifier.py --epochs 1 \
      --samples "$samples" --batch-size "$batch" > "$tree/out-$which" 2>&1 || { tail -30 "$tree/out-$which"; exit 1; }
  grep -h "balancing: \|strategy auto -> " "$tree/out-$which" || true
  "$py" - "$run/report.json" "$which" >> "$tree/rows" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
same = len({p["model_sha256"] for p in r["per_rank"]}) == 1
print(sys.argv[2], round(r["samples_per_s"], 1), r["steps"], r["samples"], round(r["wall_seconds"], 2), r["strategy"],
      str(r.get("shares")).replace(" ", ""), sum(r["bytes_sent"]), same)
PY
  tail -1 "$tree/rows" | awk '{print "run", $0}'
done
"$py" - "$tree/rows" <<'PY'
import sys
rows = [line.split() for line in open(sys.argv[1])]
mean = lambda w: sum(float(r[1]) for r in rows if r[0] == w) / sum(1 for r in rows if r[0] == w)
b, e = mean("balanced"), mean("even")
print(f"samples/s balanced {b:.1f}, --no-balance {e:.1f}: {b / e:.2f}x")
PY
