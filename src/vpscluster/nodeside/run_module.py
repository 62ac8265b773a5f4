"""Run a module of a Python package that arrives on stdin as a zip archive (zipimport).

For node-side work that needs more than the standard library (calibration times the real
model): the launcher sends its own package as a zip on stdin, so the node runs exactly the
launcher's code whether or not vpscluster is installed there. The archive is written to a
private temporary file, put first on sys.path for the run, and removed at the end.
Standard library only; run with the node's own Python (see `vpscluster.nodeside`).

Usage: python run_module.py MODULE [ARG ...]  < zip archive holding MODULE's package
"""

import os
import runpy
import sys
import tempfile


def main(argv):
    if len(argv) < 2:
        print("usage: run_module.py MODULE [ARG ...] < package.zip", file=sys.stderr)
        return 2
    data = sys.stdin.buffer.read()
    if not data.startswith(b"PK"):
        print("run_module.py: stdin is not a zip archive", file=sys.stderr)
        return 2
    fd, path = tempfile.mkstemp(prefix="vpsc-package-", suffix=".zip")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        sys.path.insert(0, path)
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    finally:
        os.remove(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
