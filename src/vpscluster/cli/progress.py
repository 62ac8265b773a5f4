"""What a person sees while training: a rich progress bar fed by worker events, then a summary.

`ProgressView` consumes the events rank 0 prints (see train/events.py) as the launch pipeline
hands them over (`on_event`; local cluster or SSH alike) and renders: a bar with step / max
steps, loss, tokens/s and the share of time spent communicating; eval and checkpoint notes above
the bar; at the end a summary table of the report. In --json mode it draws on stderr so stdout stays one document.
"""

from __future__ import annotations

from typing import Any

from vpscluster.train.shares import GAP_HINT


class ProgressView:
    def __init__(self, json_mode: bool = False, console=None) -> None:
        from vpscluster.cli.output import console as make_console

        self.console = console or make_console(json_mode)
        self._progress = None
        self._task = None
        self._val: float | None = None
        self._gap_hinted = False  # the finer-micro-batches hint is shown once per run
        self.report: dict[str, Any] | None = None
        self.errors: list[str] = []

    # ---- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> "ProgressView":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    # ---- events ---------------------------------------------------------------------------
    def handle(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        handler = getattr(self, f"_on_{kind}", None)
        if handler is not None:
            handler(event)

    def log_line(self, line: str) -> None:
        """An ordinary worker output line (warnings, errors): shown above the bar."""
        self.console.print(line, markup=False, highlight=False, style="yellow", soft_wrap=True)

    def _on_start(self, ev: dict[str, Any]) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        s = ev.get("strategy", {})
        details = ", ".join(f"{k}={v}" for k, v in s.items() if k not in ("name", "collective_busy_seconds"))
        self.console.print(
            f"training [bold]{ev.get('preset')}[/] ({ev.get('num_params', 0) / 1e6:.2f}M parameters) on "
            f"{ev.get('world_size')} rank(s), strategy [bold]{s.get('name')}[/]{' (' + details + ')' if details else ''}, "
            f"{ev.get('backend')}, {ev.get('threads_per_rank')} thread(s)/rank -> {ev.get('run_dir')}"
        )
        self.close()
        # Narrow enough for an 80-column terminal; the summary table has the wall time.
        self._progress = Progress(
            TextColumn("step"), MofNCompleteColumn(), BarColumn(bar_width=12), TextColumn("{task.fields[stats]}"),
            TextColumn("eta"), TimeRemainingColumn(compact=True), console=self.console, transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task(
            "train", total=ev.get("max_steps"), completed=ev.get("start_step", 0), stats="starting"
        )

    def _on_step(self, ev: dict[str, Any]) -> None:
        if self._progress is None:
            return
        val = f" val {self._val:.3f}" if self._val is not None else ""
        loss = f"loss {ev['loss']:.3f}" if ev.get("loss") is not None else "loss -"
        shares = f" shares {':'.join(str(v) for v in ev['shares'])}" if ev.get("shares") else ""
        stats = f"{loss}{val} {ev.get('tokens_per_s', 0):,.0f} tok/s comm {100 * ev.get('comm_share', 0):.0f}%{shares}"
        self._progress.update(self._task, completed=ev["step"], stats=stats)

    def _on_rebalance(self, ev: dict[str, Any]) -> None:
        before = ":".join(str(v) for v in ev.get("shares_before", []))
        after = ":".join(str(v) for v in ev.get("shares", []))
        self.console.print(f"step {ev['step']}: shares {before} -> {after} (rebalance {ev.get('rebalances')})")
        gap, total = ev.get("split_gap"), sum(ev.get("shares", []))
        if isinstance(gap, (int, float)) and gap > GAP_HINT and not self._gap_hinted:
            self._gap_hinted = True
            batch, rounds = ev.get("batch_size") or 1, ev.get("sync_every")
            k = next((d for d in (2, 3, 4, 5) if rounds and rounds % d == 0), None)
            if rounds:  # diloco: a micro-batch is an inner step; keep its size and the inner steps a round
                finer = (f"--micro-batches {total * k} --sync-every {rounds // k} keeps the inner steps per round" if k
                         else "more micro-batches per step and a --sync-every as many times smaller keep the inner steps per round")
            elif batch > 1:
                finer = f"--batch-size 1 --micro-batches {total * batch} keeps the global batch"
            else:
                finer = "more micro-batches per step (a larger global batch)"
            self.console.print(f"shares are whole micro-batches: this split is {gap:.0%} slower than an exact one; "
                               f"{finer} and makes the split finer", style="yellow")

    def _on_prediction(self, ev: dict[str, Any]) -> None:
        pred, meas, corr = ev.get("predicted") or {}, ev.get("measured") or {}, ev.get("corrected") or {}
        if pred.get("step_seconds") and meas.get("step_seconds"):
            err = abs(pred["step_seconds"] - meas["step_seconds"]) / meas["step_seconds"]
            fixed = f"; corrected to {corr['step_seconds']:.2f} s" if corr.get("step_seconds") else ""
            self.console.print(f"step {ev['step']}: step time predicted {pred['step_seconds']:.2f} s, "
                               f"measured {meas['step_seconds']:.2f} s ({err:.0%} off){fixed}", style="dim")

    def _on_replan(self, ev: dict[str, Any]) -> None:
        self.console.print(f"step {ev['step']}: sync plan re-made: {ev.get('reason')}")

    def _on_eval(self, ev: dict[str, Any]) -> None:
        self._val = ev["val_loss"]
        self.console.print(f"step {ev['step']}: validation loss {ev['val_loss']:.4f}")

    def _on_checkpoint(self, ev: dict[str, Any]) -> None:
        self.console.print(f"step {ev['step']}: checkpoint {ev['path']}", style="dim")

    def _on_stopping(self, ev: dict[str, Any]) -> None:
        self.console.print(f"step {ev['step']}: asked to stop; saving a checkpoint first", style="yellow")

    def _on_resume(self, ev: dict[str, Any]) -> None:
        taken, now = ev.get("checkpoint_world_size"), ev.get("world_size")
        if ev.get("step") and taken is not None and now is not None and taken != now:
            self.console.print(f"resuming from the checkpoint of step {ev['step']}, taken on {taken} ranks, "
                               f"on {now}: its data is re-cut at the same place in the epoch", style="yellow")
        elif ev.get("step"):
            self.console.print(f"resuming from the checkpoint of step {ev['step']}")
        else:
            self.console.print("no usable checkpoint: starting from step 0", style="yellow")

    def _on_error(self, ev: dict[str, Any]) -> None:
        self.errors.append(f"rank {ev.get('rank')}: {ev.get('message')}")
        self.console.print(f"rank {ev.get('rank')}: {ev.get('message')}", style="red", markup=False, soft_wrap=True)

    def _on_end(self, ev: dict[str, Any]) -> None:
        self.report = ev.get("report")
        self.close()

    # ---- summary --------------------------------------------------------------------------
    def summary(self, report: dict[str, Any]) -> None:
        from rich.table import Table

        table = Table(title="training run", show_header=False, title_justify="left")
        table.add_column("", style="bold")
        table.add_column("")
        init = report.get("initial_val_loss")
        rows = [
            ("strategy", f"{report['strategy']} on {report['world_size']} rank(s)"),
            ("steps", f"{report['steps']} (stopped by {report.get('stopped_by', 'max_steps')})"),
            ("tokens", f"{report['tokens']:,}"),
            ("wall time", f"{report['wall_seconds']:.1f} s"),
            ("throughput", f"{report['tokens_per_s']:,.0f} tokens/s"),
            ("compute / comm", f"{report['compute_seconds']:.1f} s / {report['comm_seconds']:.1f} s (mean per rank)"),
            ("compute utilization", f"{100 * report['compute_utilization']:.1f}%"),
            ("train loss", _fmt(report.get("final_train_loss"))),
            ("validation loss", (f"{init:.3f} -> " if init is not None else "") + _fmt(report.get("final_val_loss"))),
            ("bytes sent per rank", ", ".join(_fmt_bytes(b) for b in report["bytes_sent"])),
            ("run directory", str(report.get("run_dir", ""))),
        ]
        p = report.get("prediction") or {}
        if (p.get("measured") or {}).get("step_seconds"):
            e = (p.get("error") or {}).get("step_seconds")
            rows.insert(-1, ("step time", f"{p['measured']['step_seconds']:.2f} s measured, {p['predicted']['step_seconds']:.2f} s "
                                          f"predicted ({p.get('compute_source')})" + (f", {e:.0%} off" if e is not None else "")))
        rp = report.get("strategy_replanned")
        if rp:
            a = rp.get("after") or {}
            rows.insert(-1, ("sync plan", f"re-made at step {rp.get('step')}: H={a.get('sync_every')} {a.get('wire_dtype')}, "
                                          f"outer lr {a.get('outer_lr')} (measured {rp.get('measured_step_seconds', 0):.2f} s "
                                          f"per step, planned {rp.get('planned_step_seconds', 0):.2f} s)"))
        if report.get("shares"):
            rows.insert(-1, ("shares", f"{':'.join(str(v) for v in report['shares'])} of {report.get('micro_batches')} "
                                       f"micro-batches ({report.get('rebalances', 0)} rebalance(s)"
                                       + (f"; {report['split_gap']:.0%} slower than an exact split"
                                          if isinstance(report.get("split_gap"), (int, float)) else "") + ")"))
        for k, v in rows:
            table.add_row(k, v)
        self.console.print(table)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)
