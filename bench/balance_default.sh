#!/bin/bash
# Balancing by default (issue 36): 4 sandbox nodes of 0.45/0.45/0.45/0.15 cores with no balancing
# flag, against the same nodes at 0.375 each with --no-balance, one after the other in one run.
# `bash bench/balance_default.sh [STRATEGY] [BUDGET_S]` (defaults: diloco 240). Results go to
# bench/results/balance-default-STRATEGY/; the sandbox (vpscb-bal) is torn down at the end.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
V="$root/.venv/bin/vpscluster"; py=$root/.venv/bin/python
strategy=${1:-diloco}; budget=${2:-240}
out=$root/bench/results/balance-default-$strategy
mkdir -p "$out" && cd "$out" || exit 1
trap '$V sandbox down --name vpscb-bal >/dev/null 2>&1' EXIT
date -u; uptime
$V sandbox up --name vpscb-bal --nodes 4 --bandwidth 1gbit --cpu 0.45,0.45,0.45,0.15 --json > up.json || exit 1
F=$($py -c "import json; print(json.load(open('up.json'))['cluster_file'])")
common=(--cluster "$F" --preset small --strategy "$strategy" --time-budget "$budget" --max-steps 10000
        --eval-every 10000 --checkpoint-every 10000 --max-restarts 0 --json)
$V probe --cluster "$F" --json > probe-uneven.json 2> probe-uneven.err
rm -rf uneven even
$V train "${common[@]}" --run-dir "$out/uneven" > uneven.json 2> uneven.err
grep -m1 "balancing" uneven.err
for n in 1 2 3 4; do $V sandbox set --name vpscb-bal --node node-$n --cpu 0.375 > /dev/null; done
$V probe --cluster "$F" --json > probe-even.json 2> probe-even.err
$V train "${common[@]}" --no-balance --run-dir "$out/even" > even.json 2> even.err
$py - <<'PY'
import json
u, e = json.load(open('uneven.json')), json.load(open('even.json'))
for name, r in (('uneven, no flag', u), ('even, --no-balance', e)):
    print(f"{name}: {r['tokens_per_s']:.0f} tokens/s, shares {r.get('shares')} of {r.get('micro_batches')}, "
          f"speeds {r.get('speeds')}, utilisation {r['compute_utilization']:.3f}, final loss {r['final_train_loss']:.3f}")
print(f"ratio {u['tokens_per_s'] / e['tokens_per_s']:.4f}")
PY
date -u
