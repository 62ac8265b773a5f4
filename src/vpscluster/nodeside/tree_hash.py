"""SHA-256 of the given files under each root, as this node sees them (for sync).

Standard library only; run with the node's own Python (see `vpscluster.nodeside`).

Usage: python tree_hash.py '["root1", "~/root2"]'  < JSON list of relative paths on stdin
Prints {root: {path: sha256}} for the files that exist there (roots as given, `~` expanded).
"""

import hashlib
import json
import os
import sys


def file_hash(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def hashes(roots, paths):
    out = {}
    for root in roots:
        base = os.path.expanduser(root)
        found = {}
        for rel in paths:
            p = os.path.join(base, rel)
            if os.path.isfile(p):
                found[rel] = file_hash(p)
        out[root] = found
    return out


def main(argv):
    roots = json.loads(argv[1])
    paths = json.load(sys.stdin)
    json.dump(hashes(roots, paths), sys.stdout)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
