"""Unpack a tar archive into a directory (created if missing), then delete the archive.

Members are extracted with tarfile's "data" filter where this Python has it (no absolute
paths, no `..`, no devices). Standard library only; run with the node's own Python (see
`vpscluster.nodeside`).

Usage: python unpack.py ARCHIVE DEST     (`~` expanded in both)
"""

import os
import sys
import tarfile


def unpack(archive, dest):
    archive, dest = os.path.expanduser(archive), os.path.expanduser(dest)
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(archive) as t:
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        t.extractall(dest, **kw)
    os.remove(archive)


def main(argv):
    if len(argv) != 3:
        print("usage: unpack.py ARCHIVE DEST", file=sys.stderr)
        return 2
    unpack(argv[1], argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
