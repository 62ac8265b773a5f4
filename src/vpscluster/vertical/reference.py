"""The same model trained in one process: the yardstick of the split.

Same modules (built under the same seeds), same schedule, same optimizers: at staleness 0 the
split's weights must equal these after every step (tests/test_vertical.py). `zero` replaces the
named towers' embeddings by zeros, which trains the head on the remaining modality alone: the
"text only" and "image only" rows of the products example, with the same head.
"""

from __future__ import annotations

from vpscluster.vertical import data
from vpscluster.vertical.head import correct, label_tensor
from vpscluster.vertical.spec import Spec, build_module, build_optimizer, featurize, loss_fn


def train(spec: Spec, rows: list[dict], zero: tuple[str, ...] = ()) -> tuple[dict, dict[str, dict]]:
    """(report with val_accuracy and final_train_loss, {stage: state_dict})."""
    import torch

    ids = data.check_ids(rows, spec.id_column)
    pos = {i: k for k, i in enumerate(ids)}
    sched = data.schedule_for(spec, ids)
    towers = list(spec.towers)
    features = {t: featurize(spec, t, [{c: r[c] for c in [spec.id_column, *spec.towers[t].columns]} for r in rows])
                for t in towers}
    modules = {s: build_module(spec, s) for s in [*towers, "head"]}
    opts = {s: build_optimizer(spec, s, m.parameters()) for s, m in modules.items() if s not in zero}
    labels = {r[spec.id_column]: r[spec.head.label] for r in rows}
    loss_of = loss_fn(spec)

    def forward(batch):
        idx = torch.tensor([pos[i] for i in batch.ids])
        embs = []
        for t in towers:
            e = modules[t](*(f[idx] for f in features[t]))
            embs.append(torch.zeros_like(e.detach()) if t in zero else e)
        return modules["head"](*embs), label_tensor(spec, [labels[i] for i in batch.ids])

    loss = None
    for batch in sched.train_batches():
        out, y = forward(batch)
        loss = loss_of(out, y)
        for o in opts.values():
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o in opts.values():
            o.step()
    for m in modules.values():
        m.eval()
    right = seen = 0
    with torch.no_grad():
        for batch in sched.eval_batches(sched.val_ids):
            out, y = forward(batch)
            right += correct(spec, out, y) or 0
            seen += len(batch.ids)
    report = {"final_train_loss": float(loss.detach()) if loss is not None else None,
              "val_accuracy": right / seen if seen and spec.head.loss != "mse" else None, "val_samples": seen}
    return report, {s: m.state_dict() for s, m in modules.items()}
