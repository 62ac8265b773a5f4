"""The vertical split's spec: which towers read which columns on which nodes, and the head that fuses them.

A YAML file (`vpscluster vertical train --spec FILE`):

    data: products.jsonl           # JSON lines, one row (a mapping of columns) per line
    id_column: id                  # an integer per row: the sample id the head counts
    towers:
      text:
        module: myproject.towers:text_encoder     # "module:callable" -> a torch.nn.Module
        args: {vocab: 64, dim: 16}                # keyword arguments of that callable
        features: myproject.towers:text_features  # row (its columns only) -> a tensor, or a tuple of them
        columns: [description]                    # the only columns this tower's node receives
        nodes: [node-1]                           # node names, or
        labels: {gpus: "1"}                       # ... the first node carrying these labels
      image:
        ...
        nodes: [node-2, node-3]                   # several nodes: data-parallel replicas (below), or
        replicas: 2                               # ... with labels:, the first 2 nodes carrying them
    head:
      module: myproject.towers:fusion             # called as fusion(emb_text, emb_image) (towers in order)
      label: label                                # the only column the head receives (with the ids)
      loss: cross_entropy                         # cross_entropy | mse | bce_with_logits
      node: node-1                                # default: the cluster's head
    train:
      batch_size: 64
      epochs: 2                                   # or steps: N (at most that many steps)
      staleness: 0                                # K: a tower runs up to K batches ahead (0: synchronous)
      seed: 0                                     # modules, data order and the validation split
      val_fraction: 0.2
      optimizer: {name: adam, lr: 0.01}
      timeout_s: 60                               # the longest any stage waits for the queue
      checkpoint_every: 10                        # each stage's checkpoint, every N steps (0: never)
      max_restarts: 2                             # a dead stage (tower or head) is started again from it this often
                                                  # (on another live node when its own is gone)

Replicas: a tower on R nodes runs as R data-parallel replicas (stages `<tower>.0` ... `<tower>.R-1`).
Replica r receives the tower's columns of its share of the rows only (the samples at positions
r, r + R, ... of the sorted ids, `data.owner_of`) and the list of every id (for the schedule);
it runs forward on its share of each batch, the head joins the shares in the batch's order and
sends each replica the gradient of its rows, and the replicas add up their weight gradients over
the queue (`vt.<run>.sync.<tower>.<r>`, in replica order, so every replica applies the same sum
and keeps the same weights).

Resolution (`resolve`) imports every callable and refuses, one line each, what cannot work: an
unknown module or callable, a tower with no node, a column the data lacks, a feature function that
raises on the first row. Seeds: component i (towers in order, then the head) is built after
`torch.manual_seed(seed + i)`, in the split run and in the one-process reference alike.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from vpscluster.config import PYDANTIC_CONFIG, Float, Int, build, load_yaml, to_dict
from vpscluster.errors import UserError
from vpscluster.vertical.wire import token

@dataclass
class OptimizerSpec:
    __pydantic_config__ = PYDANTIC_CONFIG
    name: Literal["sgd", "adam"] = "adam"
    lr: Float = 0.01


@dataclass
class TowerSpec:
    __pydantic_config__ = PYDANTIC_CONFIG
    module: str
    features: str
    columns: list[str]
    args: dict[str, Any] = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    optimizer: OptimizerSpec | None = None  # default: train.optimizer
    replicas: Int | None = None  # default: one per node named in nodes: (1 with labels:)

    @property
    def n_replicas(self) -> int:
        return self.replicas or max(1, len(self.nodes))


@dataclass
class HeadSpec:
    __pydantic_config__ = PYDANTIC_CONFIG
    module: str
    label: str
    loss: Literal["cross_entropy", "mse", "bce_with_logits"] = "cross_entropy"
    args: dict[str, Any] = field(default_factory=dict)
    node: str | None = None
    optimizer: OptimizerSpec | None = None


@dataclass
class TrainSpec:
    __pydantic_config__ = PYDANTIC_CONFIG
    batch_size: Int = 64
    epochs: Int = 1
    steps: Int | None = None
    staleness: Int = 0
    seed: Int = 0
    val_fraction: Float = 0.2
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    timeout_s: Float = 60.0
    checkpoint_every: Int = 10  # each stage saves its weights and optimizer every N applied steps (0: never)
    max_restarts: Int = 2  # a stage's process (a tower or the head) that dies is started again from its checkpoint this often


@dataclass
class Spec:
    __pydantic_config__ = PYDANTIC_CONFIG
    towers: dict[str, TowerSpec]
    head: HeadSpec
    data: str | None = None
    id_column: str = "id"
    train: TrainSpec = field(default_factory=TrainSpec)

    def __post_init__(self) -> None:
        t = self.train
        if not self.towers:
            raise UserError("towers: none given; name at least one tower (module, features, columns, nodes)")
        for name, tower in self.towers.items():
            if not name.replace("_", "").replace("-", "").isalnum():
                raise UserError(f"towers.{name}: a tower's name is letters, digits, - and _ (it names queue subjects)")
            if not tower.nodes and not tower.labels:
                raise UserError(f"towers.{name}: no node; say where it runs with nodes: [NODE] or labels: {{KEY: VALUE}}")
            if tower.replicas is not None and (tower.replicas < 1 or (tower.nodes and tower.replicas != len(tower.nodes))):
                raise UserError(f"towers.{name}.replicas: {tower.replicas} does not fit nodes: {tower.nodes} "
                                "(one replica per node named; give replicas: with labels:, or leave it out)")
            if not tower.columns:
                raise UserError(f"towers.{name}.columns: empty; list the columns this tower reads")
            if self.head.label in tower.columns or self.id_column in tower.columns:
                raise UserError(f"towers.{name}.columns: {self.head.label if self.head.label in tower.columns else self.id_column} "
                                "is the head's label or the id column; a tower never reads it")
        tokens = [token(st) for st in self.stages()]
        if len(set(tokens)) != len(tokens):
            raise UserError("towers: a tower's name collides with another stage's (head, or NAME-rN of a tower's "
                            "replica); rename it")
        if t.batch_size < 1 or t.epochs < 1 or (t.steps is not None and t.steps < 1):
            raise UserError("train: batch_size and epochs must be >= 1 (and steps, when given)")
        if t.staleness < 0:
            raise UserError(f"train.staleness: {t.staleness} < 0; give K >= 0 (0 = synchronous)")
        if not 0 <= t.val_fraction < 1:
            raise UserError(f"train.val_fraction: {t.val_fraction} is not in [0, 1)")
        if t.checkpoint_every < 0 or t.max_restarts < 0:
            raise UserError("train: checkpoint_every and max_restarts must be >= 0")
        if t.timeout_s <= 0 or t.optimizer.lr <= 0:
            raise UserError("train: timeout_s and optimizer.lr must be positive")

    def stages(self) -> list[str]:
        """The stages in start order: each tower's (`NAME`, or `NAME.r` per replica), then "head"."""
        out = []
        for name, tower in self.towers.items():
            n = tower.n_replicas
            out += [name] if n == 1 else [f"{name}.{r}" for r in range(n)]
        return [*out, "head"]

    def optimizer_for(self, component: str) -> OptimizerSpec:
        own = self.head.optimizer if component == "head" else self.towers[component].optimizer
        return own or self.train.optimizer

    def seed_for(self, component: str) -> int:
        order = [*self.towers, "head"]
        return self.train.seed + order.index(component)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


def load(path: str | Path) -> Spec:
    """Read and check a spec file (types and cross-field rules; imports come with `resolve`).
    A relative `data:` is relative to the spec's folder."""
    p = Path(path)
    doc = load_yaml(p, "spec")
    spec = build(Spec, doc, str(p))
    if spec.data is not None and not Path(spec.data).is_absolute():
        spec.data = str((p.parent / spec.data).resolve())
    return spec


def from_dict(doc: dict[str, Any], where: str = "spec") -> Spec:
    return build(Spec, doc, where)


def import_callable(ref: str, where: str):
    """`package.module:callable` -> the callable; one UserError line when it cannot be had."""
    mod_name, sep, attr = ref.partition(":")
    if not sep or not mod_name or not attr:
        raise UserError(f"{where}: {ref!r} is not 'module:callable' (e.g. myproject.towers:text_encoder)")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        raise UserError(f"{where}: no module {e.name!r} (from {ref!r}); check the name, or run from the folder "
                        "that holds it") from None
    except Exception as e:  # the user's module failed while importing
        raise UserError(f"{where}: importing {mod_name} failed: {type(e).__name__}: {str(e).strip()[:200]}") from None
    obj = mod
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise UserError(f"{where}: module {mod_name} has no {attr!r}; check the name after the colon")
    if not callable(obj):
        raise UserError(f"{where}: {ref} is not callable")
    return obj


def code_paths(spec: Spec) -> list[str]:
    """The files or package folders holding the spec's callables, outside vpscluster itself: what a
    remote node needs to import them (top-level packages, so their relative imports work)."""
    import importlib.util
    import os

    import vpscluster

    own = os.path.dirname(os.path.abspath(vpscluster.__file__))
    refs = [*(r for t in spec.towers.values() for r in (t.module, t.features)), spec.head.module]
    out: set[str] = set()
    for ref in refs:
        top = ref.partition(":")[0].split(".")[0]
        found = importlib.util.find_spec(top)
        if found is None or found.origin in (None, "built-in", "frozen"):
            continue
        path = os.path.dirname(found.origin) if found.submodule_search_locations else found.origin
        if os.path.abspath(path) == own or "site-packages" in path or "dist-packages" in path:
            continue  # vpscluster is shipped anyway; installed libraries must be installed on the node
        out.add(os.path.abspath(path))
    return sorted(out)


def build_module(spec: Spec, component: str):
    """The torch module of a tower or the head, built under its seed (the same in every process)."""
    import torch

    s = spec.head if component == "head" else spec.towers[component]
    where = "head.module" if component == "head" else f"towers.{component}.module"
    factory = import_callable(s.module, where)
    torch.manual_seed(spec.seed_for(component))
    try:
        module = factory(**s.args)
    except Exception as e:
        raise UserError(f"{where}: {s.module}(**args) failed: {type(e).__name__}: {str(e).strip()[:200]}") from None
    if not isinstance(module, torch.nn.Module):
        raise UserError(f"{where}: {s.module} returned {type(module).__name__}, not a torch.nn.Module")
    return module


def build_optimizer(spec: Spec, component: str, params):
    import torch

    o = spec.optimizer_for(component)
    return torch.optim.SGD(params, lr=o.lr) if o.name == "sgd" else torch.optim.Adam(params, lr=o.lr)


def loss_fn(spec: Spec):
    import torch.nn.functional as F

    return {"cross_entropy": F.cross_entropy, "mse": F.mse_loss,
            "bce_with_logits": F.binary_cross_entropy_with_logits}[spec.head.loss]


def featurize(spec: Spec, tower: str, rows: list[dict[str, Any]]):
    """The tower's input tensors for `rows` (stacked): a tuple, one entry per tensor the feature
    function returns. One UserError line naming the row when it raises or returns no tensor."""
    import torch

    fn = import_callable(spec.towers[tower].features, f"towers.{tower}.features")
    per_row = []
    for row in rows:
        try:
            out = fn(row)
        except Exception as e:
            raise UserError(f"towers.{tower}.features: {spec.towers[tower].features} raised on sample "
                            f"{row.get(spec.id_column)!r}: {type(e).__name__}: {str(e).strip()[:200]}") from None
        out = out if isinstance(out, tuple) else (out,)
        if not out or not all(isinstance(x, torch.Tensor) for x in out):
            raise UserError(f"towers.{tower}.features: {spec.towers[tower].features} returned "
                            f"{type(out[0]).__name__ if out else 'nothing'}, not a tensor (or a tuple of them)")
        per_row.append(out)
    if not per_row:
        return ()
    return tuple(torch.stack([r[i] for r in per_row]) for i in range(len(per_row[0])))


def check(spec: Spec, columns: set[str], sample_row: dict[str, Any] | None) -> None:
    """Everything the launcher can check before starting anything: callables import, modules build,
    columns exist, the feature functions work on the first row."""
    if spec.id_column not in columns:
        raise UserError(f"id_column: the data has no column {spec.id_column!r}; its columns: {', '.join(sorted(columns))}")
    if spec.head.label not in columns:
        raise UserError(f"head.label: the data has no column {spec.head.label!r}; its columns: {', '.join(sorted(columns))}")
    for name, tower in spec.towers.items():
        missing = [c for c in tower.columns if c not in columns]
        if missing:
            raise UserError(f"towers.{name}.columns: the data has no column {missing[0]!r}; its columns: "
                            f"{', '.join(sorted(columns))}")
        build_module(spec, name)
        if sample_row is not None:
            featurize(spec, name, [{c: sample_row[c] for c in [spec.id_column, *tower.columns]}])
    build_module(spec, "head")
    loss_fn(spec)
