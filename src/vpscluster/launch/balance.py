"""Balancing by default on uneven nodes: the launcher's decision, written into the run's config.

A run where the user set none of `--micro-batches`, `--speeds`, `--balance`/`--no-balance`
(`strategy.balance` None) is balanced when the probe's figures say its ranks differ in speed by
more than `plan.balance.SPREAD`: the split `plan.balance.choose_split` picks (the global batch and
the inner step kept), runtime rebalancing on (`strategy.balance`: the first steps' measured times
correct a wrong probe), the starting speeds per node (`strategy.launcher.node_speeds`). Otherwise
`strategy.balance` becomes False (decided: even). The decision is made once per run: from the
cluster's last saved probe when the run is prepared (so `--dry-run` shows it), else from the
probe pre-flight takes before the first launch. The local cluster (every rank on this machine)
has no per-node figures and stays even. A resumed run keeps its stored configuration.

One decision for `train` (a TrainConfig: its batch and step counts are known) and for `run` (a
SessionConfig: the script names its batch in `s.shard(dataset, batch_size=B)`, after the launch).
A session's split keeps the script's batch: diloco's micro-batches are inner steps of B samples
(B and the inner lr keep their meaning, a round keeps its H inner steps per rank on average);
ddp's step of world x B samples is cut into k x world parts and rank i reads one batch of its
parts' samples, its gradient weighted by that size (`session/shard.py`): the step's gradient is
the mean over all world x B samples, as in the even split, and every rank makes the same steps.
A session's `auto` starts as ddp and gets ddp's split; if it switches to diloco, the session
re-chooses the split from the speeds it measured (`session/auto.py: carry_shares`). `train`'s
auto is planned before the launch (ddp or diloco) and balanced as what it chose.
"""

from __future__ import annotations

import dataclasses
import math

from vpscluster.plan.balance import balance_line, choose_split, choose_split_near, needs_balance, scaled_steps

# TrainConfig's settings counted in steps: with DiLoCo's finer split a step carries k even steps'
# tokens, so these are divided by k to train the same tokens on the same schedule.
_STEP_KEYS = ("max_steps", "warmup_steps", "lr_decay_steps", "eval_every", "log_every")


def undecided(cfg) -> bool:
    """The user left the split to the launcher and it has not decided yet."""
    s = cfg.strategy
    if s.quorum:  # uneven shares do not carry over to the quorum engine yet (quorum_diloco.py)
        return False
    return s.balance is None and not s.micro_batches and s.speeds is None and not s.launcher.node_speeds


def capacities_differ(probe: dict | None, names: list[str]) -> bool:
    """Do the nodes differ in what they have (CPU cores they really get, GPUs), not only in a
    measurement? The probe's quick FLOP/s figure of identical nodes can differ by more than
    SPREAD on a busy host (seen: 2.7x and 4.3x for a 3x quota), and balancing identical nodes
    on noise would change a DiLoCo run's step counts for nothing. Unknown facts count as
    different (the measurement decides)."""
    nodes = {n.get("name"): n for n in (probe or {}).get("nodes", []) or [] if isinstance(n, dict)}
    facts = [nodes.get(name) or {} for name in names]
    gpus = [sorted(str(g.get("name", "")) for g in f.get("gpus") or [] if isinstance(g, dict)) for f in facts]
    if any(g != gpus[0] for g in gpus):
        return True
    if gpus[0]:
        return False  # the same GPUs on every node: they do the work
    shares = [_cores(f) for f in facts]
    if not all(v is not None and v > 0 for v in shares):
        return True
    return needs_balance(shares)


def _cores(facts: dict) -> float | None:
    """The cores a node is given (its CPU affinity, capped by its cgroup quota): what it has, not
    `cpu_share` as measured under load (a busy host's figure, which differs between identical
    nodes). None when the probe lacks both."""
    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0

    affinity, quota = facts.get("cpu_affinity"), facts.get("cpu_quota_cores")
    if number(affinity):
        return min(float(affinity), float(quota)) if number(quota) else float(affinity)
    share = facts.get("cpu_share")
    return float(share) if number(share) and facts.get("cpu_share_source") != "measured" else None


def _batch(cfg) -> int | None:
    """The micro-batch a train run's split cuts (its sequences per rank); None for a session
    (`run`): the script names it in `shard()`, after the launch."""
    micro_batch = getattr(cfg, "micro_batch", None)
    return micro_batch() if callable(micro_batch) else None


def apply_default_balance(cfg, probe: dict | None, ranks: dict[str, int] | None) -> str | None:
    """Decide for an `undecided` run from `probe` (a probe document: its nodes' FLOP/s or CPU
    shares) and `ranks` (ranks per node); change `cfg` (a TrainConfig, or a SessionConfig for
    `run`) in place and return the one line to say (None: nothing to say - already decided, no
    figures yet, or even enough)."""
    from vpscluster.train.shares import node_speeds_from_probe
    from vpscluster.train.strategies import AUTO, STRATEGIES, costs_for

    if not undecided(cfg) or not ranks:
        return None
    name = cfg.strategy.name
    batch = _batch(cfg)
    auto = name == AUTO and batch is None  # a session's auto starts as ddp (session/auto.py): ddp's split
    if auto:
        name = "ddp"
    if name not in STRATEGIES or not costs_for(name).uneven_shares:
        cfg.strategy.balance = False  # decided: this strategy keeps even shares
        return None
    speeds = node_speeds_from_probe(probe, ranks)
    if speeds is None:
        return None  # not every node measured: decide later (pre-flight's probe) or stay even
    s = cfg.strategy
    if not capacities_differ(probe, list(ranks)):
        s.balance = False  # the same CPUs and GPUs everywhere: a spread in the quick FLOP/s is noise
        return None
    per_rank = [speeds[node] for node, n in ranks.items() for _ in range(n)]
    steps = costs_for(name).micro_batches_are_steps
    # diloco: a round keeps a step per fragment and its overlapped sync (at most H - 1 steps).
    round_steps = max(s.fragments, min(s.overlap_steps, s.sync_every - 1) + 1)
    moved = None
    if steps and "sync_every" in (s.launcher.planned or []):  # the plan's H, not the user's: it may move to split better
        h, choice = choose_split_near(per_rank, batch or 1, s.sync_every, round_steps, max(1, s.min_share),
                                      s.max_spread)
        if choice is not None and h != s.sync_every:
            moved = f"H = {h} instead of the plan's {s.sync_every}: its rounds split these speeds closer to exact"
            s.sync_every = h
            if s.launcher.planned_reason:
                s.launcher = dataclasses.replace(s.launcher, planned_reason=f"{s.launcher.planned_reason}; {moved}")
    else:
        # a session: diloco's split counts micro-batches of the script's batch; ddp's (None): parts of its step
        choice = choose_split(per_rank, batch or (1 if steps else None), steps, s.sync_every if steps else None, round_steps,
                              max(1, s.min_share), s.max_spread)
    if choice is None:
        s.balance = False  # decided: the even split is as good
        return None
    s.micro_batches, s.balance = choice.micro_batches, True
    s.launcher = dataclasses.replace(s.launcher, node_speeds=speeds)
    s.min_share = max(1, s.min_share)
    if batch is not None:
        cfg.batch_size = choice.batch_size
    if choice.steps_per_step > 1:
        k = choice.steps_per_step
        if batch is not None and not s.inner_lr_scale:  # keep the even run's inner lr: 1/sqrt(M) of its M
            s.inner_lr_scale = 1.0 / math.sqrt(len(per_rank))  # micro-batches (a session's lr is the script's)
        s.sync_every = choice.sync_every
        for key in _STEP_KEYS:
            if getattr(cfg, key, 0):
                setattr(cfg, key, scaled_steps(getattr(cfg, key), k))
        if cfg.checkpoint_every:  # a session's 0: only where the script saves
            cfg.checkpoint_every = scaled_steps(cfg.checkpoint_every, k, choice.sync_every)
    then = "if auto switches to diloco, the split is re-chosen from the speeds measured under ddp" if auto else None
    line = balance_line(speeds, ranks, choice, session=batch is None, then=then)
    return f"{line}; {moved}" if moved else line
