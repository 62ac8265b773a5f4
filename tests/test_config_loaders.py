"""Both loaders (training `--config` and the cluster file) against anything a user can write.

Property-based (hypothesis): arbitrary YAML values, wrong types at known keys, unknown keys and
binary junk never raise anything but `UserError`, and its message is one line naming the file.
Plus the cases users hit first: `strategy: diloco` works, `timeouts: 5` is one line naming
`timeouts`, a non-text file is one line, and a refused `train` leaves no run directory.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import run_cli
from vpscluster.cluster.inventory import ClusterFile, NodeEntry, load_cluster
from vpscluster.errors import UserError
from vpscluster.train.config import StrategyConfig, TimeoutConfig, TrainConfig

CHECKS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """One folder for the property tests; their file is rewritten for every example."""
    folder = tmp_path_factory.mktemp("loaders")
    (folder / "id_ed25519").write_text("not a key; the loader only checks that it exists\n")
    return folder


# Awkward paths and words reach the path, unit and name code: an unknown user's `~`, NUL bytes,
# line breaks, units without numbers.
AWKWARD = ["~", "~nosuchuser0/x", "a\x00b", "a\nb", "", " ", "/", ".", "id_ed25519", "1gbit", "0mbit", "2TB/month",
           "-1", "diloco", "auto", "tiny", -1, 0, 2**70, 0.5, True, None, [], {}, [{}], {"a": {"b": [1]}}]
awkward = st.sampled_from(AWKWARD)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12), awkward)
keys = st.one_of(st.text(max_size=10), st.integers(), st.booleans())
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
                      max_leaves=12)
one_value = st.one_of(awkward, values)


def names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def section(cls, extra=()):
    """A mapping of some of `cls`'s keys (plus `extra` keys) set to arbitrary, often awkward, values."""
    return st.dictionaries(st.sampled_from(names(cls) + list(extra)), one_value, max_size=4)


def write(folder: Path, doc) -> Path:
    path = folder / "doc.yaml"
    if isinstance(doc, bytes):
        path.write_bytes(doc)
    else:
        path.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    return path


def load_train(path: Path):
    """Exactly what `vpscluster train --config PATH` runs to resolve its configuration."""
    from vpscluster.cli.train import add_arguments, resolve_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return resolve_config(parser.parse_args(["--config", str(path)]))


def refused_in_one_line(load, path: Path, names_file: bool = True) -> str | None:
    try:
        load(path)
    except UserError as e:
        message = str(e)
        assert message.strip() and len(message.splitlines()) == 1, repr(message)
        if names_file:
            assert str(path) in message or "cluster file" in message, message
        return message
    return None  # accepted: fine too


train_docs = st.one_of(
    values,  # anything at all, at the top level too
    st.builds(lambda k, v: {k: v}, st.sampled_from(names(TrainConfig)), one_value),  # one key wrong, the rest valid
    st.builds(lambda k, v: {"strategy": {k: v}}, st.sampled_from(names(StrategyConfig)), one_value),
    section(TrainConfig, extra=["max_stepz", "strategy", "timeouts"]),  # wrong types at known keys, unknown keys
    st.fixed_dictionaries({"strategy": st.one_of(values, section(StrategyConfig, extra=["nme"])),
                           "timeouts": st.one_of(values, section(TimeoutConfig, extra=["rendezvous"]))}),
)


@CHECKS
@given(doc=train_docs)
def test_train_config_refuses_anything_wrong_in_one_line(work, doc):
    if isinstance(doc, dict) and isinstance(doc.get("cluster"), str):
        doc["cluster"] = str(work / "no-such-cluster.yaml")  # that message names the cluster file
    refused_in_one_line(load_train, write(work, doc), names_file=not (isinstance(doc, dict) and "cluster" in doc))


@CHECKS
@given(junk=st.binary(max_size=64))
def test_both_loaders_refuse_binary_junk_in_one_line(work, junk):
    path = write(work, junk)
    refused_in_one_line(load_train, path, names_file=False)
    refused_in_one_line(load_cluster, path)


def valid_cluster() -> dict:
    return {"known_hosts": "known_hosts", "defaults": {"user": "ubuntu", "identity_file": "id_ed25519"},
            "nodes": [{"name": "node-a", "host": "203.0.113.10", "advertised_bandwidth": "1gbit"},
                      {"name": "node-b", "host": "203.0.113.11", "port": 2222, "egress_quota": "2TB/month"}]}


top_changes = section(ClusterFile, extra=["nodez"])
node_changes = section(NodeEntry, extra=["hostname"])
@CHECKS
@given(doc=values, top=top_changes, defaults=st.one_of(values, node_changes), node=node_changes,
       key=st.sampled_from(names(ClusterFile) + names(NodeEntry)), value=one_value,
       index=st.integers(0, 1), shape=st.integers(0, 6))
def test_cluster_file_refuses_anything_wrong_in_one_line(work, doc, top, defaults, node, key, value, index, shape):
    if shape > 0:  # a valid file with wrong types or unknown keys at known places
        doc = valid_cluster()
        if shape == 1:
            doc.update(top)
        elif shape == 2:
            doc["defaults"] = defaults
        elif shape == 3:
            doc["nodes"][index].update(node)
        elif shape == 4:  # one key changed, the rest valid: reaches the code behind the schema
            doc[key] = value
        elif shape == 5:
            doc["defaults"][key] = value
        else:
            doc["nodes"][index][key] = value
    path = write(work, doc)
    if refused_in_one_line(load_cluster, path) is None:
        cluster = load_cluster(path)
        assert cluster.nodes and cluster.head in [n.name for n in cluster.nodes]


def test_every_key_with_every_awkward_value_is_one_line(work):
    """Exhaustive where the random search is thin: each known key, each awkward value, one at a time."""
    for place in ("top", "defaults", "node"):
        for key in names(ClusterFile) + names(NodeEntry):
            for value in AWKWARD:
                doc = valid_cluster()
                target = doc if place == "top" else doc["defaults"] if place == "defaults" else doc["nodes"][1]
                target[key] = value
                refused_in_one_line(load_cluster, write(work, doc))
    for section_name, cls in ((None, TrainConfig), ("strategy", StrategyConfig), ("timeouts", TimeoutConfig)):
        for key in names(cls):
            for value in AWKWARD:
                doc = {key: value} if section_name is None else {section_name: {key: value}}
                refused_in_one_line(load_train, write(work, doc), names_file=key != "cluster")


# --- the cases named in the issue --------------------------------------------------------------


def test_strategy_as_one_word_means_its_name(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("strategy: diloco\nmax_steps: 200\n")
    cfg = load_train(path)
    assert cfg.strategy == StrategyConfig(name="diloco") and cfg.max_steps == 200


def test_strategy_word_and_flags_merge(tmp_path):
    from vpscluster.cli.train import add_arguments, resolve_config

    path = tmp_path / "my.yaml"
    path.write_text("strategy: diloco\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = resolve_config(parser.parse_args(["--config", str(path), "--sync-every", "50"]))
    assert (cfg.strategy.name, cfg.strategy.sync_every) == ("diloco", 50)


@pytest.mark.parametrize("text, fragments", [
    ("timeouts: 5\n", ["my.yaml: timeouts: expected a mapping of rendezvous_s", "got 5"]),
    ("strategy: {name: ring}\n", ["my.yaml: strategy.name: 'ring' is not one of 'ddp', 'diloco', 'hierarchical' or 'auto'"]),
    ("strategy: [ddp]\n", ["my.yaml: strategy: expected a mapping of name, compress"]),
    ("max_steps: yes\n", ["my.yaml: max_steps: expected a number, got true"]),
    ("max_steps: 2.5\n", ["my.yaml: max_steps: expected an integer with no fraction, got 2.5"]),
    ("lr: .nan\n", ["my.yaml: lr: expected a finite number"]),
    ("timeouts: {rendezvous: 5}\n", ["my.yaml: timeouts: unknown key 'rendezvous'; valid keys: rendezvous_s"]),
    ("max_stepz: 1\nlr: x\n", ["my.yaml: unknown key 'max_stepz'", "(and 1 more)"]),
    ("timeouts: {rendezvous_s: -1}\n", ["my.yaml: timeouts.rendezvous_s must be positive"]),
    ("", ["my.yaml: the file is empty"]),
    ("# only a comment\n", ["my.yaml: the file is empty"]),
    ("- a\n- list\n", ["expected a mapping at the top level", "got a list"]),
])
def test_named_mistakes_are_one_line_naming_file_and_key(tmp_path, text, fragments):
    path = tmp_path / "my.yaml"
    path.write_text(text)
    message = refused_in_one_line(load_train, path)
    assert message is not None
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_a_flag_can_fix_what_the_file_alone_breaks(tmp_path):
    from vpscluster.cli.train import add_arguments, resolve_config

    path = tmp_path / "my.yaml"
    path.write_text("strategy: diloco\ncheckpoint_every: 30\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert resolve_config(parser.parse_args(["--config", str(path), "--sync-every", "10"])).strategy.sync_every == 10


@pytest.mark.parametrize("data", [bytes(range(256)), b"max_steps: 5\x00\x01\x02", "\ufeffmax_steps: [".encode("utf-16")])
def test_non_text_file_is_one_line(tmp_path, data):
    path = tmp_path / "model.bin"
    path.write_bytes(data)
    for load in (load_train, load_cluster):
        message = refused_in_one_line(load, path)
        assert message is not None and ("not a text file" in message or "not valid YAML" in message), message


def test_run_config_round_trips(tmp_path):
    from vpscluster.train import rundir

    cfg = TrainConfig(max_steps=40, lr_decay_steps=40, checkpoint_every=20, time_budget_s=30.0,
                      strategy=StrategyConfig(name="diloco", sync_every=10, wire_dtype="int8", fragments=2),
                      timeouts=TimeoutConfig(train_collective_s=30.0))
    rundir.write_config(cfg, tmp_path)
    assert rundir.read_config(tmp_path) == cfg


def test_refused_train_creates_nothing(tmp_path):
    bad_cluster = tmp_path / "cluster.yaml"
    bad_cluster.write_text("nodes: [{name: a, host: h, port: 0}]\n")
    binary = tmp_path / "my.yaml"
    binary.write_bytes(bytes(range(256)))
    cases = [(["--cluster", str(bad_cluster)], "nodes[0].port: 0 is not a port"),
             (["--config", str(binary)], "not a text file")]
    for args, expected in cases:
        r = run_cli("train", *args, cwd=str(tmp_path), timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert expected in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (tmp_path / "runs").exists()  # no run directory left behind


@pytest.mark.parametrize("text", ['known_hosts: "~nosuchuser0/kh"\nnodes: [{name: a, host: h}]\n',
                                  'nodes: [{name: a, host: h, identity_file: "~nosuchuser0/id"}]\n'])
def test_unknown_users_home_is_one_line(tmp_path, text):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    message = refused_in_one_line(load_cluster, path)
    assert message is not None and "~nosuchuser0" in message and "write the full path" in message
    assert "no home folder" in refused_in_one_line(load_cluster, Path("~nosuchuser0/cluster.yaml"), names_file=False)


def test_huge_file_is_refused_without_reading_it_whole(tmp_path):
    from vpscluster.config import MAX_FILE_BYTES

    path = tmp_path / "weights.yaml"
    with path.open("wb") as f:
        f.truncate(MAX_FILE_BYTES * 4)  # sparse: costs no disk
    message = refused_in_one_line(load_train, path)
    assert message is not None and "not a configuration" in message


# --- one source of strategy names, defaults and choices ------------------------------------------


def _choices(add_arguments) -> dict[str, tuple]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return {a.dest: tuple(a.choices) for a in parser._actions if a.choices}


def test_cli_choices_and_planner_read_the_registry_and_the_typed_config():
    from vpscluster.cli import plan as plan_cli
    from vpscluster.cli import train as train_cli
    from vpscluster.plan.api import PlanRequest
    from vpscluster.plan.auto import candidates
    from vpscluster.plan.predict import Settings
    from vpscluster.train.config import strategy_choices
    from vpscluster.train.strategies import AUTO, STRATEGIES

    assert strategy_choices("name") == (*STRATEGIES, AUTO)
    for add_arguments in (train_cli.add_arguments, plan_cli.add_arguments):
        choices = _choices(add_arguments)
        for key in ("strategy", "compress", "wire_dtype"):
            assert choices[key] == strategy_choices("name" if key == "strategy" else key)
    assert Settings() == Settings.of(StrategyConfig()) and isinstance(Settings(), StrategyConfig)
    request = PlanRequest(model="tiny")
    assert all(getattr(request, k) == getattr(StrategyConfig(), k)
               for k in ("compress", "powersgd_rank", "bucket_mb", "fragments"))
    # DiLoCo's H and wire are open in a plan request: the sync rule picks them, as train does.
    assert (request.sync_every, request.wire_dtype) == (None, None)
    seen = {(s.name, s.compress, s.wire_dtype) for s in candidates(4, sync_every_choices=(10,))}
    assert {c for n, c, _ in seen if n == "ddp"} == set(strategy_choices("compress"))
    # auto weighs the dense wires; the sparse ones (not yet measured for learning, issue 36) only when asked for.
    from vpscluster.train.strategies.sync_rule import WIRES

    assert {w for n, _, w in seen if n == "diloco"} == set(WIRES) == set(strategy_choices("wire_dtype")) - {"sparse2", "sparse4"}


def _alias_bomb() -> str:
    lines = ['a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]  # 9**9 items when expanded
    return "\n".join(lines) + "\nstrategy: *a8\ntimeouts: *a8\nnodes: *a8\ndefaults: *a8\nlabels: *a8\n"


@pytest.mark.parametrize("text", [_alias_bomb(), "strategy: &x {name: *x}\nnodes: &y [*y]\ndefaults: &z {labels: *z}\n"])
def test_aliases_that_expand_or_loop_are_refused_quickly(tmp_path, text):
    path = tmp_path / "alias.yaml"
    path.write_text(text)
    for load in (load_train, load_cluster):
        message = refused_in_one_line(load, path)
        assert message is not None and len(message) < 1000, message
