"""Unpack a tar archive into a directory (created if missing), then delete the archive.

Members are extracted with tarfile's "data" filter (no absolute paths, no `..`, no links out
of the destination, no devices), checked for every member before the first is written, so a
refused archive leaves the destination as it was. A Python whose tarfile lacks the filter
(before 3.12, 3.11.4, 3.10.12, 3.9.17 or 3.8.17) is refused in one line: a plain `extractall`
writes wherever the archive says. Standard library only; run with the node's own Python (see
`vpscluster.nodeside`).

Usage: python unpack.py ARCHIVE DEST     (`~` expanded in both)
"""

import os
import sys
import tarfile

NEEDS = "Python 3.12, or 3.11.4, 3.10.12, 3.9.17, 3.8.17 or later"


class Refused(Exception):
    pass


def unpack(archive, dest):
    archive, dest = os.path.expanduser(archive), os.path.expanduser(dest)
    try:
        if not hasattr(tarfile, "data_filter"):
            version = ".".join(str(n) for n in sys.version_info[:3])
            raise Refused(f"this node's Python {version} cannot unpack safely (its tarfile has no "
                          f"'data' filter); install {NEEDS} there and name it as the node's python")
        with tarfile.open(archive) as t:
            members = t.getmembers()
            for m in members:  # every member first: nothing is written from a refused archive
                try:
                    tarfile.data_filter(m, dest)
                except tarfile.FilterError as e:
                    raise Refused(f"{archive}: member {m.name!r} refused ({e}); nothing unpacked") from None
            os.makedirs(dest, exist_ok=True)
            t.extractall(dest, members=members, filter="data")
    finally:
        try:
            os.remove(archive)
        except OSError:
            pass


def main(argv):
    if len(argv) != 3:
        print("usage: unpack.py ARCHIVE DEST", file=sys.stderr)
        return 2
    try:
        unpack(argv[1], argv[2])
    except Refused as e:
        print(f"unpack: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
