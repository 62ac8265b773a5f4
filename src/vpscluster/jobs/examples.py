"""Bundled batch jobs that run with no download: `vpscluster batch --example NAME`.

- `sentiment`: VADER sentiment scores (Hutto & Gilbert, ICWSM 2014; the lexicon ships inside
  the `vaderSentiment` package) of user comments. With no `--input`, a deterministic comments
  file is generated from the bundled corpus (verses mixed with everyday praise and complaints).
- `perplexity`: per-document perplexity under a model trained with `vpscluster train`
  (`--checkpoint RUN_DIR`: the newest checkpoint there; the file is shipped to every node).
  With no `--input`, documents are generated from the bundled corpus (chapters cut to pieces).
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path

from vpscluster.errors import UserError

_OPENERS = ["", "", "honestly", "wow", "ugh", "lol", "imo", "well", "not gonna lie", "seriously"]
_TAKES = ["I love this", "this is great", "terrible, just terrible", "not bad at all", "meh", "so boring",
          "absolutely wonderful", "worst thing I have read", "pretty good", "I hate it", "this made my day",
          "kind of sad", "not great, not terrible", "brilliant!!", "what a waste of time", ":)", ":(",
          "very helpful, thanks", "I am disappointed", "AMAZING"]


@dataclass(frozen=True)
class Example:
    name: str
    fn: str
    about: str


EXAMPLES = {
    "sentiment": Example("sentiment", "vpscluster.jobs.examples:sentiment",
                         "VADER sentiment of generated user comments (vaderSentiment's bundled lexicon)"),
    "perplexity": Example("perplexity", "vpscluster.jobs.examples:perplexity",
                          "per-document perplexity under a checkpoint of `vpscluster train` (--checkpoint RUN_DIR)"),
}


def example(name: str) -> Example:
    if name not in EXAMPLES:
        raise UserError(f"--example {name}: no such example; choose one of {', '.join(sorted(EXAMPLES))}")
    return EXAMPLES[name]


_analyzer = None


def sentiment(rows: list[dict]) -> list[dict]:
    """{"id", "compound", "pos", "neu", "neg", "label"} per comment (row: {"id", "text"})."""
    global _analyzer
    if _analyzer is None:  # once per worker process: loading the lexicon takes ~0.1 s
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        _analyzer = SentimentIntensityAnalyzer()
    out = []
    for r in rows:
        s = _analyzer.polarity_scores(str(r["text"]))
        label = "positive" if s["compound"] >= 0.05 else "negative" if s["compound"] <= -0.05 else "neutral"
        out.append({"id": r.get("id"), "compound": s["compound"], "pos": s["pos"], "neu": s["neu"],
                    "neg": s["neg"], "label": label})
    return out


def _verses() -> list[str]:
    from vpscluster.jobs import examples as me

    corpus = Path(me.__file__).resolve().parents[1] / "data" / "kjv.txt.gz"
    with gzip.open(corpus, "rt", encoding="utf-8") as f:
        text = f.read()
    return [v.strip() for v in re.split(r"\n\s*\d+ ", text) if 20 < len(v.strip()) < 400 and "\n\n" not in v]


def generate_comments(path: str, rows: int, seed: int = 0) -> str:
    """Write `rows` comments as JSONL (deterministic for a seed); atomically, so a half-written
    file is never taken for a finished one."""
    from vpscluster.jobs.outputs import write_atomic

    rng = random.Random(seed)
    verses = [" ".join(v.split()) for v in _verses()]
    lines = []
    for i in range(rows):
        verse = rng.choice(verses)
        words = verse.split()
        cut = " ".join(words[: rng.randint(min(4, len(words)), min(len(words), 25))])
        opener, take = rng.choice(_OPENERS), rng.choice(_TAKES)
        text = f"{opener + ', ' if opener else ''}{take}: \"{cut}\"" if rng.random() < 0.7 else cut
        lines.append(json.dumps({"id": i, "text": text}))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, ("\n".join(lines) + "\n").encode())
    return path


def generate_documents(path: str, rows: int, seed: int = 0) -> str:
    """`rows` documents of 2-6 consecutive verses each, as JSONL {"id", "text"}."""
    from vpscluster.jobs.outputs import write_atomic

    rng = random.Random(seed)
    verses = [" ".join(v.split()) for v in _verses()]
    lines = []
    for i in range(rows):
        start = rng.randrange(len(verses) - 6)
        lines.append(json.dumps({"id": i, "text": " ".join(verses[start:start + rng.randint(2, 6)])}))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, ("\n".join(lines) + "\n").encode())
    return path


def example_input(name: str, rows: int) -> str:
    """The generated input of an example (made once, then reused from the cache folder)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vpscluster" / "examples"
    make, stem = (generate_comments, "comments") if name == "sentiment" else (generate_documents, "documents")
    path = cache / f"{stem}-{rows}.jsonl"
    if not path.exists():
        make(str(path), rows)
    return str(path)


def newest_checkpoint(run_dir: str) -> tuple[str, str]:
    """(rank 0's shard of the newest complete checkpoint, the model preset) of a training run."""
    from vpscluster.train.rundir import CHECKPOINTS, read_config

    cfg = read_config(run_dir)  # a folder without config.yaml is refused in one line there
    steps = sorted(Path(run_dir, CHECKPOINTS).glob("step-*/manifest.json"))
    if not steps:
        raise UserError(f"--checkpoint {run_dir}: the run has no complete checkpoint yet; train longer "
                        "(checkpoints are written every --checkpoint-every steps and at the end)")
    return str(steps[-1].parent / "rank-00000.pt"), cfg.preset


_models: dict = {}


def perplexity(rows: list[dict], checkpoint: str, preset: str) -> list[dict]:
    """{"id", "tokens", "nll", "perplexity"} per document (row: {"id", "text"}), byte-level as
    the model was trained; documents longer than the context are scored window by window."""
    import math

    import torch

    from vpscluster.train.checkpoint import load_shard
    from vpscluster.train.data import encode
    from vpscluster.train.model import build_model
    from vpscluster.train.presets import get_preset

    if checkpoint not in _models:  # once per worker process
        shape = get_preset(preset)
        model = build_model(shape, seed=0)
        payload = load_shard(Path(checkpoint), checkpoint)  # plain data only: no code from the file runs
        model.load_state_dict(payload["model"])
        model.eval()
        _models[checkpoint] = model
    model = _models[checkpoint]
    seq_len = model.shape.seq_len
    out = []
    with torch.no_grad():
        for r in rows:
            tokens = encode(str(r["text"]))
            total, count = 0.0, 0
            for start in range(0, max(0, len(tokens) - 1), seq_len):
                window = tokens[start:start + seq_len + 1]
                if len(window) < 2:
                    break
                t = torch.tensor(window, dtype=torch.long)[None]
                n = t.shape[1] - 1
                total += float(model(t[:, :-1], t[:, 1:])) * n
                count += n
            nll = total / count if count else None
            out.append({"id": r.get("id"), "tokens": count, "nll": nll,
                        "perplexity": math.exp(nll) if nll is not None else None})
    return out
