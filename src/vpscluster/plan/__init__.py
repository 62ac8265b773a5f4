"""Plan: predict memory, step time, traffic and time to train before launching; choose a strategy.

    shapes      the model: a preset or a Hugging Face config.json
    resources   nodes and links from the probe, the cluster file and flags (assumptions stated)
    memory      per-rank memory by strategy and layout (ZeRO accounting, Korthikanti activations)
    compute     step compute from measured FLOP/s; calibrate: the model's share of matmul FLOP/s
    comm        ring order, α–β collectives, DDP bucket overlap
    predict     one strategy's step time, utilization, egress; auto: the choice and its reason
    guidance    least memory, link rate for 90% DDP utilization, disk speed for checkpoints
    api         make_plan (the `vpscluster plan --json` document); report renders it

What a strategy sends, holds and offers is its own cost companion's (`train/strategies/costs.py`,
one `*_costs.py` per strategy), and DiLoCo's sync rule is `train/strategies/sync_rule.py`: both
torch-free, below plan, so the ranks (`train/replan.py`) use them without importing the planner.
"""
