"""The vertical split on this machine: towers and head as local processes, a real nats-server on
loopback (a private one per run, queue/server.serve_private), the products example's modules.

- K = 0: after N steps every parameter of every stage equals the one-process model's on the same
  batches (vertical/reference.py), and `predict` gives the reference model's predictions;
- K = 1: the towers run a batch ahead (weights then differ from the synchronous ones), it learns;
- the head counts every sample id exactly once per epoch, a partial last epoch included;
- each stage receives only its columns (the head alone the labels);
- bad specs: one line each, non-zero exit, nothing started;
- a killed tower, or the head, resumes from its checkpoint (K = 0: still the reference's weights);
- a tower as 2 replicas: each gets its share of the rows; the weights are still the reference's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import run_cli

pytestmark = pytest.mark.skipif(shutil.which("nats-server") is None, reason="no nats-server (apt install nats-server)")

ROWS = 320  # val 64, train 256: 4 batches of 64 per epoch


def _spec(data: Path, staleness: int = 0, steps: int | None = 6, epochs: int = 2, **train):
    from vpscluster.vertical import products, spec

    doc = products.spec_doc(str(data), ["local"], "local", staleness=staleness, epochs=epochs)
    doc["train"].update({"steps": steps, **train})
    return spec.from_dict(doc)


@pytest.fixture(scope="module")
def products_data(tmp_path_factory) -> tuple[Path, list[dict]]:
    from vpscluster.vertical import products

    rows = products.generate(ROWS, seed=3)
    path = tmp_path_factory.mktemp("vertical") / "products.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


@pytest.fixture(scope="module")
def sync_run(products_data, tmp_path_factory):
    from vpscluster.vertical import launch

    path, _ = products_data
    run_dir = tmp_path_factory.mktemp("k0")
    spec = _spec(path)
    return spec, launch.train(spec, run_dir=run_dir, say=lambda _: None)


def test_k0_split_equals_one_process(sync_run, products_data):
    import torch

    from vpscluster.vertical import reference

    spec, report = sync_run
    _, rows = products_data
    ref_report, ref_states = reference.train(spec, rows)
    stages = Path(report["run_dir"]) / "stages"
    for stage, ref in ref_states.items():
        got = torch.load(stages / stage / ("head.pt" if stage == "head" else f"tower-{stage}.pt"), weights_only=True)
        assert got.keys() == ref.keys()
        for name in ref:
            assert torch.allclose(got[name], ref[name], rtol=1e-5, atol=1e-6), f"{stage}.{name}"
        # the run changed them: equal to the trained reference, not to the initial weights
        from vpscluster.vertical.spec import build_module

        assert any(not torch.equal(got[n], v) for n, v in build_module(spec, stage).state_dict().items())
    assert report["final_train_loss"] == pytest.approx(ref_report["final_train_loss"], rel=1e-5)
    assert report["val_accuracy"] == pytest.approx(ref_report["val_accuracy"])


def test_sample_ids_counted_exactly_once(sync_run):
    _, report = sync_run
    assert report["steps"] == 6 and report["samples"] == 6 * 64
    assert report["epochs"] == [
        {"epoch": 0, "samples": 256, "unique": 256, "expected": 256, "exactly_once": True},  # the whole epoch
        {"epoch": 1, "samples": 128, "unique": 128, "expected": 128, "exactly_once": True},  # 2 steps of the next
    ]
    assert report["exactly_once"] and report["val_samples"] == ROWS - 256
    assert report["bytes_per_sample"] > 2 * 16 * 4 * 2  # two towers' embeddings and gradients, float32
    # the run's stream and its checkpoints' bucket were on disk (JetStream's file store) and are deleted at the end
    store = Path(report["run_dir"]) / "queue" / "store" / "jetstream"
    assert store.is_dir() and not list(store.rglob(f"vt_{report['run_id']}"))
    assert not list(store.rglob(f"OBJ_vtckpt_{report['run_id']}"))


def test_each_stage_receives_only_its_columns(sync_run, products_data):
    _, report = sync_run
    _, rows = products_data
    sent = Path(report["run_dir"]) / "send"
    want = {"text": {"id", "description"}, "image": {"id", "image"}, "head": {"id", "label"}}
    assert sorted(p.name for p in sent.iterdir()) == sorted(want)
    for stage, columns in want.items():
        files = list((sent / stage).iterdir())
        assert [f.name for f in files] == ["rows.jsonl"]
        got = [json.loads(line) for line in files[0].read_text().splitlines()]
        assert [set(r) for r in got] == [columns] * ROWS
        assert got == [{c: r[c] for c in columns} for r in rows]
    # the processes read those files and nothing else of the data
    spec_sent = json.loads((Path(report["run_dir"]) / "spec.json").read_text())
    assert set(spec_sent) == {"towers", "head", "data", "id_column", "train"}


def test_predict_gives_the_reference_predictions(sync_run, products_data, tmp_path):
    import torch

    from vpscluster.vertical import launch, reference
    from vpscluster.vertical.spec import build_module, featurize

    spec, report = sync_run
    _, rows = products_data
    out = launch.predict(spec, report["run_dir"], run_dir=tmp_path / "p", say=lambda _: None)
    got = {r["id"]: r["prediction"] for r in map(json.loads, Path(out["predictions"]).read_text().splitlines())}
    _, states = reference.train(spec, rows)
    mods = {s: build_module(spec, s) for s in states}
    for s, m in mods.items():
        m.load_state_dict(states[s])
        m.eval()
    with torch.no_grad():
        embs = [mods[t](*featurize(spec, t, rows)) for t in spec.towers]
        want = mods["head"](*embs).argmax(-1).tolist()
    assert got == {r["id"]: p for r, p in zip(rows, want)}
    assert out["rows"] == ROWS and out["accuracy"] == pytest.approx(sum(
        p == r["label"] for r, p in zip(rows, want)) / ROWS)


def test_k1_runs_ahead_and_learns(tmp_path):
    """The example's size (smaller data is memorised, not learnt): 1600 training rows, 8 epochs."""
    import torch

    from vpscluster.vertical import launch, products, reference

    rows = products.generate(2000, seed=5)
    path = tmp_path / "products.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = _spec(path, staleness=1, steps=None, epochs=8)
    report = launch.train(spec, run_dir=tmp_path / "run", say=lambda _: None)
    assert report["staleness"] == 1 and report["steps"] == 200 and report["exactly_once"]
    assert all(e["exactly_once"] and e["samples"] == 1600 for e in report["epochs"]) and len(report["epochs"]) == 8
    assert report["val_accuracy"] >= 0.9, report  # XOR of the two modalities: chance is 0.5
    # a tower a batch ahead: its gradients are one step stale, so the weights are not the synchronous ones
    _, sync_states = reference.train(_spec(path, steps=None, epochs=8), rows)
    got = torch.load(Path(report["run_dir"]) / "stages" / "text" / "tower-text.pt", weights_only=True)
    assert any(not torch.allclose(got[n], v, atol=1e-4) for n, v in sync_states["text"].items())


BAD = {
    "unknown module": ({"towers.text.module": "no_such_pkg.towers:text_tower"}, "towers.text.module: no module 'no_such_pkg'"),
    "unknown callable": ({"towers.text.module": "vpscluster.vertical.products:nope"}, "has no 'nope'"),
    "tower with no node": ({"towers.image.nodes": []}, "towers.image: no node"),
    "unknown column": ({"towers.image.columns": ["picture"]}, "towers.image.columns: the data has no column 'picture'"),
    "feature function raises": ({"towers.text.features": "vertical_bad_features:explode"},
                                "towers.text.features: vertical_bad_features:explode raised on sample 0: KeyError"),
    "node not in the cluster": ({"towers.text.nodes": ["nowhere"]}, None),
    "replicas that do not fit the nodes": ({"towers.image.nodes": ["local", "local"], "towers.image.replicas": 3},
                                           "towers.image.replicas: 3 does not fit nodes: ['local', 'local']"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_spec_one_line(case, products_data, tmp_path):
    import yaml

    from vpscluster.vertical import products

    path, _ = products_data
    doc = products.spec_doc(str(path), ["local"], "local")
    changes, message = BAD[case]
    for dotted, value in changes.items():
        *parents, key = dotted.split(".")
        node = doc
        for p in parents:
            node = node[p]
        node[key] = value
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(doc, sort_keys=False))
    (tmp_path / "vertical_bad_features.py").write_text("def explode(row):\n    return row['price']\n")
    args = ["vertical", "train", "--spec", str(spec_file), "--run-dir", str(tmp_path / "run")]
    if message is None:  # names a node: checked against a cluster file
        (tmp_path / "cluster.yaml").write_text(yaml.safe_dump({"nodes": [{"name": "a", "host": "10.0.0.5"}]}))
        args += ["--cluster", str(tmp_path / "cluster.yaml")]
        message = "towers.text.nodes: no node 'nowhere' in the cluster; its nodes: a"
    r = run_cli(*args, timeout=60, cwd=str(tmp_path))
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written or started


def test_tower_killed_resumes_from_its_checkpoint(products_data, tmp_path):
    """kill -9 of the text tower's process mid-run: the launcher starts it again with --resume, it
    goes on from its last checkpoint, the head waits on the queue; every sample is trained exactly
    once per epoch and (K = 0) every parameter still equals the one-process model's."""
    import os
    import signal

    import torch

    from conftest import processes_mentioning
    from vpscluster.vertical import launch, reference

    path, rows = products_data
    spec = _spec(path, steps=16, epochs=4, checkpoint_every=3)
    run_dir = tmp_path / "run"
    lines, killed = [], []

    def say(line: str) -> None:
        lines.append(line)
        if not killed and line.startswith("[head@local] step 5/16"):
            for pid in processes_mentioning(str(run_dir / "stages" / "text")):
                if b"python" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]:  # not its shell
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)

    report = launch.train(spec, run_dir=run_dir, say=say)
    assert killed and report["restarts"] == {"text": 1}, lines
    resumed = [ln for ln in lines if "resumed from its checkpoint after step" in ln]
    assert len(resumed) == 1 and int(resumed[0].rsplit(" ", 1)[1]) in (3, 6), lines  # not from the start
    assert report["exactly_once"] and [e["samples"] for e in report["epochs"]] == [256] * 4
    _, ref_states = reference.train(spec, rows)
    for stage, ref in ref_states.items():
        got = torch.load(run_dir / "stages" / stage / ("head.pt" if stage == "head" else f"tower-{stage}.pt"),
                         weights_only=True)
        for name in ref:
            assert torch.allclose(got[name], ref[name], rtol=1e-5, atol=1e-6), f"{stage}.{name}"


def test_head_killed_resumes_from_its_checkpoint(products_data, tmp_path):
    """kill -9 of the head's process mid-run: the launcher starts it again with --resume; it goes on
    from its checkpoint (weights, optimizer, the sample ids it counted), reads the embeddings anew
    from the stream, and the towers skip the gradients it sends again. Every sample is trained
    exactly once per epoch and (K = 0) every parameter equals the one-process model's."""
    import os
    import signal

    import torch

    from conftest import processes_mentioning
    from vpscluster.vertical import launch, reference

    path, rows = products_data
    spec = _spec(path, steps=16, epochs=4, checkpoint_every=3)
    run_dir = tmp_path / "run"
    lines, killed = [], []

    def say(line: str) -> None:
        lines.append(line)
        if not killed and line.startswith("[head@local] step 5/16"):
            for pid in processes_mentioning(str(run_dir / "stages" / "head")):
                if b"python" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]:  # not its shell
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)

    report = launch.train(spec, run_dir=run_dir, say=say)
    assert killed and report["restarts"] == {"head": 1}, lines
    resumed = [ln for ln in lines if "head: resumed from its checkpoint after step" in ln]
    assert len(resumed) == 1, lines
    start = int(resumed[0].rsplit(" ", 1)[1])
    assert start % 3 == 0 and 3 <= start < 16 and report["head_resumed_from"] == start, lines  # not from the start
    assert report["exactly_once"] and [e["samples"] for e in report["epochs"]] == [256] * 4
    assert report["val_samples"] == ROWS - 256
    _, ref_states = reference.train(spec, rows)
    for stage, ref in ref_states.items():
        got = torch.load(run_dir / "stages" / stage / ("head.pt" if stage == "head" else f"tower-{stage}.pt"),
                         weights_only=True)
        for name in ref:
            assert torch.allclose(got[name], ref[name], rtol=1e-5, atol=1e-6), f"{stage}.{name}"


def test_tower_replicas_split_the_rows_and_train_as_one(products_data, tmp_path):
    """The image tower as 2 data-parallel replicas (stages image.0 and image.1), K = 0: each replica
    receives only its share of the rows (disjoint, together all of them) and the list of ids; the
    head joins their shares of each batch, and the replicas add their weight gradients over the
    queue, so both hold the same weights and every stage's equal the one-process model's. One
    replica killed mid-run resumes from its checkpoint; each sample is still trained once per epoch."""
    import os
    import signal

    import torch

    from conftest import processes_mentioning
    from vpscluster.vertical import launch, products, reference, spec as spec_mod

    path, rows = products_data
    doc = products.spec_doc(str(path), ["local"], "local", epochs=4)
    doc["towers"]["image"]["nodes"] = ["local", "local"]
    doc["train"].update({"steps": 12, "checkpoint_every": 3})
    spec = spec_mod.from_dict(doc)
    assert spec.stages() == ["text", "image.0", "image.1", "head"]
    run_dir = tmp_path / "run"
    lines, killed = [], []

    def say(line: str) -> None:
        lines.append(line)
        if not killed and line.startswith("[head@local] step 5/12"):
            for pid in processes_mentioning(str(run_dir / "stages" / "image.1")):
                if b"python" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]:  # not its shell
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)

    report = launch.train(spec, run_dir=run_dir, say=say)
    assert killed and report["restarts"] == {"image.1": 1}, lines
    resumed = [ln for ln in lines if "tower image.1: resumed from its checkpoint after step" in ln]
    assert len(resumed) == 1 and int(resumed[0].rsplit(" ", 1)[1]) in (3, 6), lines  # not from the start
    assert report["replicas"] == {"text": 1, "image": 2}
    assert report["exactly_once"] and [e["samples"] for e in report["epochs"]] == [256, 256, 256]
    assert report["val_samples"] == ROWS - 256

    shares = [[json.loads(ln) for ln in (run_dir / "send" / f"image.{r}" / "rows.jsonl").read_text().splitlines()]
              for r in (0, 1)]
    assert all(set(x) == {"id", "image"} for share in shares for x in share)
    got_ids = [{x["id"] for x in share} for share in shares]
    assert not got_ids[0] & got_ids[1] and got_ids[0] | got_ids[1] == {r["id"] for r in rows}
    assert abs(len(got_ids[0]) - len(got_ids[1])) <= 1
    for r in (0, 1):
        assert json.loads((run_dir / "send" / f"image.{r}" / "ids.json").read_text()) == sorted(x["id"] for x in rows)

    _, ref_states = reference.train(spec, rows)
    weights = {st: torch.load(run_dir / "stages" / st / ("head.pt" if st == "head" else
                                                         f"tower-{st.split('.')[0]}.pt"), weights_only=True)
               for st in spec.stages()}
    for name in ref_states["image"]:  # the replicas apply the same sum in the same order: equal bit for bit
        assert torch.equal(weights["image.0"][name], weights["image.1"][name]), name
    for st, got in weights.items():
        ref = ref_states[st.split(".")[0]]
        for name in ref:  # the sum of the shares' gradients is taken in another order than one batch's
            assert torch.allclose(got[name], ref[name], rtol=1e-4, atol=1e-5), f"{st}.{name}"


def test_replicas_placed_by_nodes_or_labels(tmp_path):
    """One stage NAME.r per replica: on the nodes named, or on the first `replicas:` nodes carrying
    the tower's labels; too few such nodes is one line naming the fix."""
    from vpscluster.cluster.inventory import cluster_from_mapping
    from vpscluster.errors import UserError
    from vpscluster.vertical import launch, products, spec as spec_mod

    cluster = cluster_from_mapping({"nodes": [{"name": "a", "host": "10.0.0.5"},
                                              {"name": "b", "host": "10.0.0.6", "labels": {"gpus": "1"}},
                                              {"name": "c", "host": "10.0.0.7", "labels": {"gpus": "1"}}]},
                                   "cluster.yaml", base_dir=tmp_path)
    doc = products.spec_doc("x.jsonl", ["a", "b", "c"], "a")
    doc["towers"]["text"]["nodes"] = ["b", "c"]
    doc["towers"]["image"] = {**doc["towers"]["image"], "nodes": [], "labels": {"gpus": "1"}, "replicas": 2}
    assert launch.place(spec_mod.from_dict(doc), cluster) == {
        "text.0": "b", "text.1": "c", "image.0": "b", "image.1": "c", "head": "a"}
    doc["towers"]["image"]["replicas"] = 3
    with pytest.raises(UserError, match=r"towers.image.labels: 2 node\(s\) of the cluster carry .* 3 replica\(s\) wanted"):
        launch.place(spec_mod.from_dict(doc), cluster)


def test_only_the_code_the_spec_names_travels(tmp_path, monkeypatch):
    """A remote node gets the spec's own packages and module files, not the folder they sit in
    (which may hold the dataset); vpscluster's and installed libraries' modules are not listed."""
    from vpscluster.vertical import products, spec

    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "towers.py").write_text("def text_tower(**kw):\n    pass\n")
    (tmp_path / "fusion.py").write_text("def head(**kw):\n    pass\n")
    (tmp_path / "products.jsonl").write_text("{}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    doc = products.spec_doc("x", ["a"], "a")
    doc["towers"]["text"]["module"] = "mypkg.towers:text_tower"
    doc["towers"]["text"]["features"] = "torch.nn:Identity"
    doc["head"]["module"] = "fusion:head"
    assert spec.code_paths(spec.from_dict(doc)) == [str(tmp_path / "fusion.py"), str(tmp_path / "mypkg")]
