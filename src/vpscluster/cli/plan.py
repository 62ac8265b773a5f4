"""`vpscluster plan`: predict memory, step time, egress and time to train; pick a strategy."""

from __future__ import annotations

import argparse

from vpscluster.cli.output import add_json_flag


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def _flops(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not GFLOP/s (a number, or one per node: 80,80,27)") from None


def _tokens(text: str) -> float:
    t = text.strip().lower().replace("_", "")
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(t[-1:], 1.0)
    try:
        value = float(t[:-1] if scale != 1.0 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count; write e.g. 2e9, 300M or 2B") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be positive")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Choices and defaults come from the strategy registry and the typed config, never copied.
    from vpscluster.train.config import StrategyConfig, strategy_choices
    from vpscluster.train.strategies import AUTO

    s = StrategyConfig()
    parser.add_argument("--model", required=True, metavar="PRESET|config.json",
                        help="a preset (tiny, small, 125m, 350m, 1.3b, 7b) or a Hugging Face config.json")
    parser.add_argument("--tokens", type=_tokens, metavar="N",
                        help="tokens to train on, e.g. 2B (default: 20 per parameter)")
    parser.add_argument("--cluster", metavar="FILE", help="cluster file (its last probe is used when there is one)")
    parser.add_argument("--probe", metavar="FILE", help="a probe JSON (`vpscluster probe --out FILE`)")
    parser.add_argument("--strategy", default=AUTO, choices=strategy_choices("name"),
                        help=f"plan this strategy, or let {AUTO} choose (default)")
    parser.add_argument("--nodes", type=_positive_int, metavar="N",
                        help="without a cluster file: plan N local worker processes")
    parser.add_argument("--batch-size", type=_positive_int, metavar="B", help="sequences per rank per step")
    parser.add_argument("--seq-len", type=_positive_int, metavar="T", help="tokens per sequence (default: the model's)")
    parser.add_argument("--compress", choices=strategy_choices("compress"), default=s.compress,
                        help=f"ddp: gradient compression (default {s.compress})")
    parser.add_argument("--powersgd-rank", type=_positive_int, default=s.powersgd_rank,
                        help=f"ddp+powersgd: rank of the factors (default {s.powersgd_rank})")
    parser.add_argument("--sync-every", type=_positive_int, default=None, metavar="H",
                        help="diloco: inner steps per sync (default: the sync rule's choice, as train makes it)")
    parser.add_argument("--wire-dtype", choices=strategy_choices("wire_dtype"), default=None,
                        help="diloco: pseudo-gradient encoding (default: the sync rule's choice, as train makes it)")
    parser.add_argument("--fragments", type=_positive_int, default=s.fragments,
                        help=f"diloco: streaming fragments (default {s.fragments})")
    parser.add_argument("--bandwidth", metavar="RATE", help="assume this rate on every link (e.g. 100mbit) instead of the probe's")
    parser.add_argument("--rtt-ms", type=float, metavar="MS", help="assume this round-trip time on every link")
    parser.add_argument("--flops", metavar="GFLOPS[,...]", type=_flops,
                        help="assume this fp32 GFLOP/s per rank instead of the probe's; one per node (e.g. 80,80,27) for uneven nodes")
    parser.add_argument("--memory", metavar="SIZE", help="assume this memory per rank (e.g. 32GB) instead of the probe's")
    parser.add_argument("--mixed-precision", action="store_true",
                        help="plan bf16 mixed precision on GPU nodes (vpscluster's trainer itself trains in fp32)")
    parser.add_argument("--calibrate", action="store_true",
                        help="time a few training steps of this model on every node (all at once, under a minute; cached per node and shape)")
    parser.add_argument("--threads-per-rank", type=_positive_int, metavar="N",
                        help="torch threads each rank will use (for --calibrate; default: the probe's)")
    parser.add_argument("--checkpoint-load-s", type=float, default=60.0, metavar="S",
                        help="guidance: load a checkpoint within S seconds (default 60)")
    add_json_flag(parser)


def run(args: argparse.Namespace) -> int:
    from vpscluster.cli.output import console, emit_json
    from vpscluster.errors import UserError
    from vpscluster.plan.api import PlanRequest, make_plan
    from vpscluster.plan.report import render
    from vpscluster.units import parse_rate_mbit, parse_size_bytes

    if args.rtt_ms is not None and args.rtt_ms < 0:
        raise UserError(f"--rtt-ms must not be negative, got {args.rtt_ms}")
    flops = args.flops or []
    if any(f <= 0 for f in flops):
        raise UserError(f"--flops must be positive GFLOP/s, got {','.join(f'{f:g}' for f in flops)}")
    if len(flops) > 1 and not args.cluster and not args.probe and args.nodes is None:
        args.nodes = len(flops)  # one figure per local node: that many nodes
    if args.cluster and args.nodes:
        raise UserError("--nodes plans local workers; with --cluster the cluster file says how many nodes")
    memory_bytes = parse_size_bytes(args.memory, "--memory") if args.memory else None
    if memory_bytes is not None and memory_bytes <= 0:
        raise UserError("--memory must be positive, e.g. 32GB")
    req = PlanRequest(
        model=args.model, tokens=args.tokens, cluster=args.cluster, probe=args.probe, strategy=args.strategy,
        batch_size=args.batch_size, seq_len=args.seq_len, nodes=args.nodes,
        bandwidth_mbit=parse_rate_mbit(args.bandwidth, "--bandwidth") if args.bandwidth else None,
        rtt_ms=args.rtt_ms, flops=flops[0] * 1e9 if flops else None, memory_bytes=memory_bytes,
        flops_per_node=[f * 1e9 for f in flops] if len(flops) > 1 else None,
        compress=args.compress, powersgd_rank=args.powersgd_rank, sync_every=args.sync_every,
        wire_dtype=args.wire_dtype, fragments=args.fragments, calibrate=args.calibrate,
        threads_per_rank=args.threads_per_rank, mixed_precision=args.mixed_precision,
        checkpoint_load_s=args.checkpoint_load_s,
    )
    out = console(args.json)
    if args.calibrate:
        out.print("calibrating: timing a few training steps of this model on every node…")
    doc = make_plan(req)
    if args.json:
        emit_json(doc)
    else:
        render(doc, out)
    return 0
