"""`vpscluster vertical train --example products`: generate the data, train the split, compare.

The split (text tower, image tower, fusion head, over the queue) gives the fused accuracy, its
samples/s and bytes per sample on the queue; the same head on the same batches in one process
(vertical/reference.py) gives the fused model without the queue and each modality alone (the
other tower's embedding zeroed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

EXAMPLES = ("products",)


def run(name: str, cluster=None, run_dir: str | Path | None = None, staleness: int = 0, rows: int = 2000,
        epochs: int = 8, baselines: bool = True, say: Callable[[str], None] = print, **size) -> dict:
    """`size`: products.spec_doc's model sizes (dim, image_hidden, image_depth); default the example's."""
    from vpscluster.errors import UserError
    from vpscluster.cluster.inventory import local_cluster
    from vpscluster.vertical import launch, products, reference, spec as spec_mod

    if name not in EXAMPLES:
        raise UserError(f"no example {name!r}; examples: {', '.join(EXAMPLES)}")
    import uuid

    cluster = cluster or local_cluster()
    run_dir = Path(run_dir or Path("runs") / f"vertical-{name}-{uuid.uuid4().hex[:6]}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    data_path = run_dir / "products.jsonl"
    table = products.generate(rows)
    data_path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in table))
    spec = spec_mod.from_dict(products.spec_doc(str(data_path), [n.name for n in cluster.nodes], cluster.head,
                                                staleness=staleness, epochs=epochs, **size), "example products")
    say(f"products: {rows} generated rows (text + 8x8 image, label = premium XOR top) in {data_path}")
    report = launch.train(spec, cluster, run_dir / "split", say=say)
    doc = {"example": name, **report}
    if baselines:
        say("baselines: the same head on the same batches in one process (fused, text only, image only)")
        doc["baselines"] = {label: reference.train(spec, table, zero)[0]["val_accuracy"] for label, zero in
                            (("fused_one_process", ()), ("text_only", ("image",)), ("image_only", ("text",)))}
    (run_dir / "report.json").write_text(json.dumps(doc, indent=2) + "\n")
    return doc
