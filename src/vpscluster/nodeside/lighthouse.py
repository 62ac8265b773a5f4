"""torchft's lighthouse on a node, for the quorum engine (`launch/quorum.py` starts it on the head).

Standard library only; run with the node's own Python (see `vpscluster.nodeside`). Finds
`torchft_lighthouse` (the Rust binary installed with torchft) next to this Python, else on
PATH, starts it bound to ADDRESS:PORT, waits until it accepts connections (at most 20 s) and
prints one line, `lighthouse listening on http://ADDRESS:PORT`, that the launcher waits for.
Then it waits on the binary and exits with its status; SIGTERM or SIGINT stops the binary
first. A binary that is missing or does not listen: one line on stderr and exit status 2.

Usage: python lighthouse.py ADDRESS PORT MIN_REPLICAS JOIN_TIMEOUT_MS HEARTBEAT_TIMEOUT_MS
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

BINARY = "torchft_lighthouse"
READY = "lighthouse listening on "


def binary():
    here = os.path.join(os.path.dirname(sys.executable), BINARY)
    return here if os.path.isfile(here) else shutil.which(BINARY)


def main(argv):
    if len(argv) != 6:
        print("usage: lighthouse.py ADDRESS PORT MIN_REPLICAS JOIN_TIMEOUT_MS HEARTBEAT_TIMEOUT_MS", file=sys.stderr)
        return 2
    address, port, min_replicas, join_ms, heartbeat_ms = argv[1:]
    found = binary()
    if not found:
        print(f"error: no {BINARY} next to {sys.executable} or on PATH: pip install 'torchft==0.2.0' into the "
              "node's Python", file=sys.stderr, flush=True)
        return 2
    host = f"[{address}]" if ":" in address else address
    env = dict(os.environ)
    env.setdefault("RUST_LOG", "warn")  # info logs every quorum status twice a second
    proc = subprocess.Popen([found, "--bind", f"{host}:{port}", "--min_replicas", min_replicas,
                             "--join_timeout_ms", join_ms, "--heartbeat_timeout_ms", heartbeat_ms],
                            stdin=subprocess.DEVNULL, env=env)

    def stop(signum, _frame):
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    deadline = time.monotonic() + 20.0
    while True:
        if proc.poll() is not None:
            print(f"error: {BINARY} on {host}:{port} exited with status {proc.returncode} before it listened",
                  file=sys.stderr, flush=True)
            return 2
        try:
            with socket.create_connection((address, int(port)), timeout=0.5):
                break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                print(f"error: {BINARY} did not listen on {host}:{port} within 20 s", file=sys.stderr, flush=True)
                return 2
            time.sleep(0.05)
    print(f"{READY}http://{host}:{port}", flush=True)
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
