"""Unpack a tar archive into a directory (created if missing), then delete the archive.

Every member is checked before the first is written, so a refused archive leaves the
destination as it was. Where tarfile has the "data" filter (Python 3.12, 3.11.4, 3.10.12, 3.9.17,
3.8.17 or later), members are checked and extracted with it: no absolute paths, no `..`, no
links out of the destination, no devices. A Python without it (Debian 12's 3.11.2, for one) gets
a stricter rule instead of a plain `extractall`, which would write wherever the archive says:
only regular files and directories whose path stays inside the destination, written with this
user as owner and without setuid/setgid or group/other write bits (what vpscluster's own
archives hold: they carry files, links followed). Anything else is refused in one line. Standard
library only; run with the node's own Python (see `vpscluster.nodeside`).

Usage: python unpack.py ARCHIVE DEST     (`~` expanded in both)
"""

import os
import sys
import tarfile


class Refused(Exception):
    pass


def _check_plain(member, dest):
    """The rule where tarfile has no data filter: a regular file or a directory inside `dest`,
    made ours and stripped of special mode bits; anything else raises Refused."""
    if not (member.isreg() or member.isdir()):
        raise Refused(f"member {member.name!r} refused (not a regular file or directory, and this node's "
                      f"Python {'.'.join(map(str, sys.version_info[:3]))} has no tarfile 'data' filter to "
                      f"check it); nothing unpacked")
    root = os.path.realpath(dest)
    target = os.path.realpath(os.path.join(root, member.name))
    if os.path.isabs(member.name) or os.path.commonpath([root, target]) != root:
        raise Refused(f"member {member.name!r} refused (outside the destination); nothing unpacked")
    member.mode &= 0o755  # no setuid/setgid/sticky, no group or other write
    member.uid, member.gid, member.uname, member.gname = os.getuid(), os.getgid(), "", ""


def unpack(archive, dest):
    archive, dest = os.path.expanduser(archive), os.path.expanduser(dest)
    has_filter = hasattr(tarfile, "data_filter")
    try:
        with tarfile.open(archive) as t:
            members = t.getmembers()
            for m in members:  # every member first: nothing is written from a refused archive
                if not has_filter:
                    try:
                        _check_plain(m, dest)
                    except Refused as e:
                        raise Refused(f"{archive}: {e}") from None
                    continue
                try:
                    tarfile.data_filter(m, dest)
                except tarfile.FilterError as e:
                    raise Refused(f"{archive}: member {m.name!r} refused ({e}); nothing unpacked") from None
            os.makedirs(dest, exist_ok=True)
            if has_filter:
                t.extractall(dest, members=members, filter="data")
            else:
                t.extractall(dest, members=members)  # checked above, member by member
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
