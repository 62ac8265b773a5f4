"""Batch jobs on the local cluster: a real Dask scheduler and workers on this machine.

Outputs equal a single-process run row for row, every partition exactly once; a failing attempt
is retried; a row the function raises on is named (fail) or left out (skip); an interrupted job
re-run does not recompute finished partitions; user mistakes are one line each, before anything
starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vpscluster.cluster.inventory import local_cluster
from vpscluster.jobs.outputs import read_rows
from vpscluster.jobs.run import BatchSpec, run_batch

FNS = textwrap.dedent('''
    import os, time, hashlib
    from vpscluster.jobs import dataframe_fn

    def score(rows):
        return [{"id": r["id"], "h": hashlib.sha256(str(r["text"]).encode()).hexdigest()[:12],
                 "n": len(str(r["text"]))} for r in rows]

    @dataframe_fn
    def score_df(df):
        df = df.copy()
        df["n"] = df["text"].astype(str).str.len()
        return df[["id", "n"]]

    def flaky(rows):
        # The first attempt of the partition holding id 25 fails; the retry succeeds.
        if any(r["id"] == 25 for r in rows):
            marker = os.path.join(os.environ["FLAKY_DIR"], "failed-once")
            if not os.path.exists(marker):
                open(marker, "w").close()
                raise RuntimeError("transient failure")
        return score(rows)

    def bad_row(rows):
        for r in rows:
            if r["id"] == 17:
                raise ValueError("cannot score id 17")
        return score(rows)

    def straggle(rows):
        # The first attempt of partition 0 hangs for a long time; any other attempt is quick.
        if rows[0]["id"] == 0:
            marker = os.path.join(os.environ["FLAKY_DIR"], "straggled")
            if not os.path.exists(marker):
                open(marker, "w").close()
                time.sleep(60)
        time.sleep(0.05)
        return score(rows)

    def slow(rows):
        time.sleep(0.3)
        return score(rows)

    def gated(rows):
        # Every partition but the first waits (up to 60 s) until the test opens the gate.
        if rows[0]["id"] != 0:
            deadline = time.time() + 60
            while not os.path.exists(os.path.join(os.environ["FLAKY_DIR"], "gate")) and time.time() < deadline:
                time.sleep(0.05)
        return score(rows)

    def with_token(rows, token):
        return [{"id": r["id"], "token_ok": token == "s3cret-Value"} for r in rows]

    def hang(rows):
        # The partition holding id 12 hangs: only its first attempt (HANG_ONCE set), or every one.
        if any(r["id"] == 12 for r in rows):
            marker = os.path.join(os.environ["FLAKY_DIR"], "hung")
            if not (os.environ.get("HANG_ONCE") and os.path.exists(marker)):
                open(marker, "w").close()
                time.sleep(60)
        return score(rows)

    def big(rows):
        # The partition holding id 12 makes 400 MB resident for a moment.
        if any(r["id"] == 12 for r in rows):
            blob = b"x" * (400 * 2**20)
            time.sleep(2)
            del blob
        return score(rows)
''')


@pytest.fixture
def code(tmp_path):
    d = tmp_path / "code"
    d.mkdir()
    (d / "batchfns.py").write_text(FNS)
    return d


def make_input(path: Path, rows: int = 100) -> Path:
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"id": i, "text": f"comment {i} " + "x" * (i % 13)}) + "\n")
    return path


def serial(code: Path, fn: str, rows: list[dict]) -> list[dict]:
    sys.path.insert(0, str(code))
    try:
        import importlib

        mod = importlib.import_module("batchfns")
        mod = importlib.reload(mod)
        return getattr(mod, fn)(rows)
    finally:
        sys.path.remove(str(code))


def outputs(out: Path) -> list[dict]:
    rows = []
    for p in sorted(out.glob("part-*")):
        rows += read_rows(str(p))
    return rows


def digest(rows: list[dict]) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


def assignments(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "_assignments.jsonl").read_text().splitlines()]


def test_outputs_equal_a_serial_run_each_partition_once(code, tmp_path):
    data = make_input(tmp_path / "in.jsonl", 95)
    out = tmp_path / "out"
    r = run_batch(BatchSpec(fn="batchfns:score", input=str(data), output=str(out), partition_rows=10,
                            code_dir=str(code)), local_cluster())
    assert r.ok, r.error
    assert r.partitions == 10 and r.partitions_done == 10 and r.rows_in == 95 and r.rows_out == 95
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert digest(outputs(out)) == digest(serial(code, "score", rows))
    assert sorted(p.name for p in out.glob("part-*")) == [f"part-{i:05d}.jsonl" for i in range(10)]
    assert not list(out.glob(".*.tmp"))
    manifest = json.loads((out / "_manifest.json").read_text())
    assert [p["index"] for p in manifest["partitions_list"]] == list(range(10))
    assert sum(v["partitions"] for v in r.per_node.values()) == 10
    done = [a["partition"] for a in assignments(out) if a["event"] == "done"]
    assert sorted(done) == list(range(10))  # each exactly once


def test_csv_and_parquet_inputs_dataframe_fn_parquet_output(code, tmp_path):
    import pandas as pd

    rows = [{"id": i, "text": f"t{i}" * (i % 5 + 1)} for i in range(40)]
    folder = tmp_path / "in"
    folder.mkdir()
    pd.DataFrame(rows[:25]).to_csv(folder / "a.csv", index=False)
    pd.DataFrame(rows[25:]).to_parquet(folder / "b.parquet")
    out = tmp_path / "out"
    r = run_batch(BatchSpec(fn="batchfns:score_df", input=str(folder), output=str(out), partition_rows=10,
                            code_dir=str(code), output_format="parquet"), local_cluster())
    assert r.ok, r.error
    # a.csv: 3 partitions (10, 10, 5), b.parquet: 2 (10, 5): partitions never span files.
    assert r.partitions == 5
    got = outputs(out)
    assert [g["id"] for g in got] == list(range(40))
    assert [g["n"] for g in got] == [len(x["text"]) for x in rows]


def test_failed_attempt_is_retried_and_row_errors_are_named_or_skipped(code, tmp_path, monkeypatch):
    monkeypatch.setenv("FLAKY_DIR", str(tmp_path))  # the workers inherit it
    data = make_input(tmp_path / "in.jsonl", 60)
    r = run_batch(BatchSpec(fn="batchfns:flaky", input=str(data), output=str(tmp_path / "o1"), partition_rows=10,
                            code_dir=str(code), retries=1), local_cluster())
    assert r.ok, r.error
    assert r.retries == 1 and r.partitions_done == 6
    log = assignments(tmp_path / "o1")
    assert [a["partition"] for a in log if a["event"] == "retry"] == [2]
    assert sorted(a["partition"] for a in log if a["event"] == "done") == list(range(6))

    r = run_batch(BatchSpec(fn="batchfns:bad_row", input=str(data), output=str(tmp_path / "o2"), partition_rows=10,
                            code_dir=str(code), retries=0), local_cluster())
    assert not r.ok
    assert r.error.startswith("partition 1 row 8 (in.jsonl row 18): ValueError: cannot score id 17"), r.error
    assert "\n" not in r.error

    # The same job goes on with --on-error skip: finished partitions are kept, the bad row left out.
    kept = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "o2").glob("part-*")}
    r = run_batch(BatchSpec(fn="batchfns:bad_row", input=str(data), output=str(tmp_path / "o2"), partition_rows=10,
                            code_dir=str(code), on_error="skip"), local_cluster())
    assert r.ok, r.error
    assert r.partitions_resumed == len(kept) and r.partitions_done == 6 - len(kept)
    assert [s["where"] for s in r.rows_skipped] == ["in.jsonl row 18"]
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "o2").glob("part-*") if p.name in kept} == kept
    got = outputs(tmp_path / "o2")
    assert len(got) == 59 and 17 not in [g["id"] for g in got]


def test_interrupted_job_rerun_skips_finished_partitions(cli, code, tmp_path):
    data = make_input(tmp_path / "in.jsonl", 200)
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "vpscluster", "batch", "--fn", "batchfns:slow", "--input", str(data),
            "--output", str(out), "--partition-rows", "10", "--code", str(code), "--workers-per-node", "2", "--json"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Dask's start on a busy machine took over 60 s once (CI): interrupt only once 4 are written.
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and p.poll() is None and len(list(out.glob("part-*"))) < 4:
        time.sleep(0.1)
    if p.poll() is not None or len(list(out.glob("part-*"))) < 4:
        p.kill()
        raise AssertionError(f"4 partitions not written in 240 s: {p.communicate(timeout=60)[1][-2000:]}")
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    first = {f.name: f.stat().st_mtime_ns for f in out.glob("part-*")}
    assert 4 <= len(first) < 20, err
    assert "interrupted" in err.strip().splitlines()[-1]

    r = cli("batch", "--fn", "batchfns:slow", "--input", str(data), "--output", str(out), "--partition-rows", "10",
            "--code", str(code), "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["partitions_resumed"] == len(first) and doc["partitions_done"] == 20 - len(first)
    assert {f.name: f.stat().st_mtime_ns for f in out.glob("part-*") if f.name in first} == first  # not rewritten
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert digest(outputs(out)) == digest(serial(code, "score", rows))
    assert len(list(out.glob("part-*"))) == 20
    # The manifest lists every partition of the output, the earlier run's too (its records).
    listed = json.loads((out / "_manifest.json").read_text())["partitions_list"]
    assert [p["index"] for p in listed] == list(range(20))
    assert {p["file"] for p in listed if p.get("resumed")} == set(first)
    assert all(p["node"] and p["rows_out"] == 10 for p in listed)


def test_a_second_job_on_the_same_output_is_refused_while_the_first_writes(cli, code, tmp_path):
    """Two jobs on one --output: the second is refused in one line (naming the first), so it
    cannot delete the first's temporary files; the first finishes every partition."""
    data = make_input(tmp_path / "in.jsonl", 60)
    out = tmp_path / "out"
    argv = ["batch", "--fn", "batchfns:gated", "--input", str(data), "--output", str(out), "--partition-rows", "10",
            "--code", str(code), "--workers-per-node", "2", "--json"]
    env = {**os.environ, "FLAKY_DIR": str(tmp_path)}
    first = subprocess.Popen([sys.executable, "-m", "vpscluster", *argv], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (out / "part-00000.jsonl").exists() and first.poll() is None:
            time.sleep(0.05)
        second = cli(*argv, timeout=60, env={"FLAKY_DIR": str(tmp_path)})  # the first waits at the gate meanwhile
        (tmp_path / "gate").touch()
        out_first, err_first = first.communicate(timeout=120)
    finally:
        (tmp_path / "gate").touch()
        if first.poll() is None:  # a failed assertion above: stop it as a user would, so it tears down
            first.send_signal(signal.SIGINT)
            try:
                first.wait(timeout=60)
            except subprocess.TimeoutExpired:
                first.kill()
    lines = second.stderr.strip().splitlines()
    assert second.returncode != 0 and len(lines) == 1, second.stderr
    assert f"another batch job (pid {first.pid} on" in lines[0] and "--output" in lines[0], lines[0]
    assert first.returncode == 0, err_first
    assert json.loads(out_first)["partitions_done"] == 6
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert digest(outputs(out)) == digest(serial(code, "score", rows))
    assert not list(out.glob(".part-*.tmp"))


def test_param_values_are_not_written_to_the_output_folder(code, tmp_path):
    """`--param` values reach the function but land in `_job.json` / `_manifest.json` only as
    digests (a value may be a token); the same value resumes, another is another job; an output
    folder an earlier version wrote (values verbatim) still resumes, and loses the value."""
    data = make_input(tmp_path / "in.jsonl", 20)
    out = tmp_path / "out"

    def job(token):
        return run_batch(BatchSpec(fn="batchfns:with_token", input=str(data), output=str(out), partition_rows=10,
                                   code_dir=str(code), params={"token": token}), local_cluster())

    r = job("s3cret-Value")
    assert r.ok, r.error
    assert [row["token_ok"] for row in outputs(out)] == [True] * 20
    on_disk = "".join(p.read_text() for p in out.iterdir() if p.is_file())
    assert "s3cret-Value" not in on_disk
    record = json.loads((out / "_job.json").read_text())
    assert record["params"]["token"].startswith("sha256:")
    assert json.loads((out / "_manifest.json").read_text())["job"] == record

    assert job("s3cret-Value").partitions_resumed == 2  # the same job: nothing recomputed
    with pytest.raises(Exception, match="holds the results of another job"):
        job("another-value")
    (out / "_job.json").write_text(json.dumps({**record, "params": {"token": "s3cret-Value"}}))  # as written before
    assert job("s3cret-Value").partitions_resumed == 2
    assert "s3cret-Value" not in (out / "_job.json").read_text() + (out / "_manifest.json").read_text()


@pytest.mark.parametrize("args, message", [
    (["--fn", "batchfns:nope"], "--fn batchfns:nope: batchfns has no function 'nope'"),
    (["--fn", "nomodule:f"], "--fn nomodule:f: no module 'nomodule'"),
    (["--fn", "batchfns"], "--fn batchfns: write it as MODULE:FUNCTION"),
    (["--fn", "batchfns:score", "--input", "missing.jsonl"], "--input missing.jsonl: no such file or folder"),
    (["--fn", "batchfns:score", "--input", "bad.jsonl"], "line 2 is not JSON"),
    (["--fn", "batchfns:score", "--input", "latin1.jsonl"], "line 1 is not UTF-8 text"),
    (["--fn", "batchfns:score", "--input", "corrupt.parquet"], "not a readable Parquet file"),
    (["--fn", "batchfns:score", "--partition-rows", "0"], "--partition-rows 0: must be at least 1"),
    (["--fn", "batchfns:score", "--task-timeout", "0"], "--task-timeout 0: seconds, more than 0"),
    (["--fn", "batchfns:score", "--task-memory", "-5"], "--task-memory -5: megabytes, more than 0"),
])
def test_user_mistakes_are_one_line(cli, code, tmp_path, args, message):
    make_input(code / "in.jsonl", 5)
    (code / "bad.jsonl").write_text('{"id": 1, "text": "a"}\n{oops\n')
    (code / "latin1.jsonl").write_bytes('{"text": "caf\u00e9"}\n'.encode("latin-1"))
    (code / "corrupt.parquet").write_bytes(b"PAR1 this is not parquet")
    if "--input" not in args:
        args = args + ["--input", "in.jsonl"]
    started = time.monotonic()
    r = cli("batch", *args, "--output", str(tmp_path / "out"), cwd=str(code), timeout=60)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert time.monotonic() - started < 30  # refused before any Dask process started


def test_output_folder_of_another_job_is_refused(cli, code, tmp_path):
    data = make_input(tmp_path / "in.jsonl", 10)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    r = cli("batch", "--fn", "batchfns:score", "--input", str(data), "--output", str(out), "--code", str(code))
    assert r.returncode != 0 and "is not empty and holds no batch job" in r.stderr.strip()
    assert len(r.stderr.strip().splitlines()) == 1


def test_bundled_examples_sentiment_and_perplexity(cli, tmp_path, monkeypatch):
    import torch

    from vpscluster.jobs import examples
    from vpscluster.train.model import build_model
    from vpscluster.train.presets import get_preset

    # sentiment, as a user tries it: generated comments, no download.
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    r = cli("batch", "--example", "sentiment", "--rows", "3000", "--partition-rows", "1000", "--output",
            str(tmp_path / "s"), "--workers-per-node", "1", "--json", env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["rows_out"] == 3000
    comments = [json.loads(line) for line in (tmp_path / "cache/vpscluster/examples/comments-3000.jsonl").read_text().splitlines()]
    assert outputs(tmp_path / "s") == examples.sentiment(comments)
    assert {row["label"] for row in outputs(tmp_path / "s")} == {"positive", "negative", "neutral"}

    # perplexity with a checkpoint shipped to the workers as a parameter file.
    ckpt = tmp_path / "rank-00000.pt"
    torch.save({"model": build_model(get_preset("tiny"), seed=3).state_dict()}, ckpt)
    docs = tmp_path / "docs.jsonl"
    examples.generate_documents(str(docs), 12)
    res = run_batch(BatchSpec(fn="vpscluster.jobs.examples:perplexity", input=str(docs), output=str(tmp_path / "p"),
                              partition_rows=4, params={"preset": "tiny"}, ship={"checkpoint": str(ckpt)},
                              workers_per_node=1), local_cluster())
    assert res.ok, res.error
    rows = [json.loads(line) for line in docs.read_text().splitlines()]
    want = examples.perplexity(rows, checkpoint=str(ckpt), preset="tiny")
    got = outputs(tmp_path / "p")
    assert [g["id"] for g in got] == list(range(12))
    assert all(abs(g["nll"] - w["nll"]) < 1e-5 for g, w in zip(got, want))
    assert all(200 < g["perplexity"] < 300 for g in got)  # an untrained byte model: ~ vocabulary size


def test_straggler_gets_a_backup_and_output_is_written_once(code, tmp_path, monkeypatch):
    monkeypatch.setenv("FLAKY_DIR", str(tmp_path))
    data = make_input(tmp_path / "in.jsonl", 80)
    out = tmp_path / "out"
    started = time.monotonic()
    r = run_batch(BatchSpec(fn="batchfns:straggle", input=str(data), output=str(out), partition_rows=10,
                            code_dir=str(code), workers_per_node=2), local_cluster())
    assert r.ok, r.error
    assert time.monotonic() - started < 50  # did not wait for the 60 s straggler
    assert r.backups == 1 and r.backups_won == 1 and r.duplicated_rows == 10
    manifest = json.loads((out / "_manifest.json").read_text())
    assert [p["backup"] for p in manifest["partitions_list"]] == [True] + [False] * 7
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert digest(outputs(out)) == digest(serial(code, "score", rows))
    assert sorted(a["partition"] for a in assignments(out) if a["event"] == "done") == list(range(8))


def test_plain_dask_placement_baseline_gives_the_same_outputs(code, tmp_path):
    # The benchmark's "dask" mode: every partition submitted at once, placed by Dask alone.
    data = make_input(tmp_path / "in.jsonl", 50)
    out = tmp_path / "out"
    r = run_batch(BatchSpec(fn="batchfns:score", input=str(data), output=str(out), partition_rows=5,
                            code_dir=str(code), placement="dask", admission=False, speculation=False), local_cluster())
    assert r.ok, r.error
    assert r.partitions_done == 10 and r.backups == 0
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert digest(outputs(out)) == digest(serial(code, "score", rows))


def test_each_worker_has_its_next_partition_queued_never_more(code, tmp_path):
    # Two partitions in flight per worker: the one it runs and the next, so it never waits on the loop.
    data = make_input(tmp_path / "in.jsonl", 100)
    out = tmp_path / "out"
    r = run_batch(BatchSpec(fn="batchfns:slow", input=str(data), output=str(out), partition_rows=5,
                            code_dir=str(code), workers_per_node=2), local_cluster())
    assert r.ok, r.error
    events = assignments(out)
    assert any(e["event"] == "assign" and e["queued"] for e in events)
    in_flight: dict[str, set] = {}
    by_partition = {}
    for e in events:
        if e["event"] == "assign":
            in_flight.setdefault(e["worker"], set()).add(e["partition"])
            by_partition[e["partition"]] = e["worker"]
            assert len(in_flight[e["worker"]]) <= 2, e
        elif e["event"] in ("done", "withdraw"):
            in_flight[by_partition[e["partition"]]].discard(e["partition"])
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert digest(outputs(out)) == digest(serial(code, "score", rows))
    assert sorted(a["partition"] for a in events if a["event"] == "done") == list(range(20))


def test_task_timeout_fails_the_attempt_and_retries_then_names_the_partition(code, tmp_path, monkeypatch):
    monkeypatch.setenv("FLAKY_DIR", str(tmp_path))
    data = make_input(tmp_path / "in.jsonl", 40)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    # The first attempt hangs past the limit and is killed; the retry finishes (no speculation: a
    # backup copy would win first).
    monkeypatch.setenv("HANG_ONCE", "1")
    started = time.monotonic()
    r = run_batch(BatchSpec(fn="batchfns:hang", input=str(data), output=str(tmp_path / "o1"), partition_rows=10,
                            code_dir=str(code), retries=1, task_timeout_s=2, workers_per_node=2, speculation=False),
                  local_cluster())
    assert r.ok, r.error
    assert time.monotonic() - started < 45  # did not wait for the 60 s hang
    assert r.retries == 1 and r.backups == 0
    retry = [e for e in assignments(tmp_path / "o1") if e["event"] == "retry"]
    assert [e["partition"] for e in retry] == [1]
    assert "ran longer than --task-timeout 2 s" in retry[0]["error"]
    assert digest(outputs(tmp_path / "o1")) == digest(serial(code, "score", rows))
    assert sorted(e["partition"] for e in assignments(tmp_path / "o1") if e["event"] == "done") == [0, 1, 2, 3]

    # Every attempt hangs: after the retries the job stops with one line naming the partition.
    monkeypatch.delenv("HANG_ONCE")
    out = tmp_path / "o2"
    r = run_batch(BatchSpec(fn="batchfns:hang", input=str(data), output=str(out), partition_rows=10,
                            code_dir=str(code), retries=1, task_timeout_s=2, workers_per_node=2, speculation=False),
                  local_cluster())
    assert not r.ok
    assert r.error.startswith("partition 1 (in.jsonl rows 11-20) ran longer than --task-timeout 2 s on "), r.error
    assert r.error.endswith("(after 2 attempts)") and "\n" not in r.error
    assert "part-00001.jsonl" not in {p.name for p in out.glob("part-*")}
    assert not list(out.glob(".*.tmp"))
    done = [e["partition"] for e in assignments(out) if e["event"] == "done"]
    assert len(done) == len(set(done)) == len(list(out.glob("part-*")))


def test_task_memory_limit_fails_the_partition_in_one_line_and_a_rerun_completes(code, tmp_path):
    data = make_input(tmp_path / "in.jsonl", 40)
    out = tmp_path / "out"
    r = run_batch(BatchSpec(fn="batchfns:big", input=str(data), output=str(out), partition_rows=10,
                            code_dir=str(code), task_memory_mb=200, workers_per_node=2), local_cluster())
    assert not r.ok
    assert r.error.startswith("partition 1 (in.jsonl rows 11-20) used "), r.error
    assert "over --task-memory 200 MB; raise --task-memory or lower --partition-rows" in r.error
    assert "\n" not in r.error and r.retries == 0  # not retried: it would need as much anywhere
    assert "part-00001.jsonl" not in {p.name for p in out.glob("part-*")}
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*")}

    r = run_batch(BatchSpec(fn="batchfns:big", input=str(data), output=str(out), partition_rows=10,
                            code_dir=str(code), task_memory_mb=1000, workers_per_node=2), local_cluster())
    assert r.ok, r.error
    assert r.partitions_resumed == len(kept)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("part-*") if p.name in kept} == kept
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert digest(outputs(out)) == digest(serial(code, "score", rows))  # nothing lost, nothing twice


def test_admission_load_falls_back_to_direct_samples_without_a_monitor(code, tmp_path, monkeypatch):
    import socket

    from vpscluster.jobs.load import monitor_busy
    from vpscluster.monitor.server import record_path

    monkeypatch.setenv("HOME", str(tmp_path))  # the monitor record lives under ~/.cache
    cluster = local_cluster()
    assert monitor_busy(cluster) is None  # no `monitor up` for this cluster
    # A record whose Prometheus is gone (nothing listens on its port): no answer, no figures.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    path = record_path(cluster)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"head": "local", "url": f"http://127.0.0.1:{port}", "monitor_dir": str(tmp_path),
                                "prometheus_pid": 0, "scrape_interval_s": 5.0}))
    started = time.monotonic()
    assert monitor_busy(cluster) is None
    assert time.monotonic() - started < 5
    data = make_input(tmp_path / "in.jsonl", 30)
    r = run_batch(BatchSpec(fn="batchfns:slow", input=str(data), output=str(tmp_path / "out"), partition_rows=5,
                            code_dir=str(code), load_interval_s=0.2), cluster)
    assert r.ok, r.error
    assert r.load_source == "proc"  # admission sampled /proc and the cgroup itself
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert digest(outputs(tmp_path / "out")) == digest(serial(code, "score", rows))


def test_admission_withdraws_above_max_load_and_readmits_only_below_the_margin():
    from vpscluster.jobs.dispatch import admission

    admitted = {"a": True, "b": True}
    # a load hovering around the threshold: out above 0.8, back only at 0.7 or below
    trace = []
    for load in (0.5, 0.85, 0.79, 0.75, 0.81, 0.7, 0.79, 0.82):
        admitted = admission({"a": load, "b": 0.1}, admitted, max_load=0.8, margin=0.1)
        trace.append(admitted["a"])
    assert trace == [True, False, False, False, False, True, True, False]
    assert admitted["b"] is True
    # unknown load: admitted; every node busy: the least busy keeps working
    assert admission({"a": None, "b": 0.95}, {"a": False, "b": True}, 0.8, 0.1) == {"a": True, "b": False}
    assert admission({"a": 0.9, "b": 0.95}, {"a": True, "b": True}, 0.8, 0.1) == {"a": True, "b": False}
    assert admission({}, {}, 0.8, 0.1) == {}
