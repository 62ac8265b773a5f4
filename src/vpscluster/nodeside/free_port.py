"""A TCP port that is free on this node now, for the family of the given address.

Standard library only; run with the node's own Python (see `vpscluster.nodeside`). The one
free-port helper: the controller imports `free_port` for ports on its own machine (local
services, tests). A port is free when asked, not reserved: use it at once.

Usage: python free_port.py [ADDRESS]     (IPv6 when ADDRESS holds a ':', else IPv4)
Prints the port number alone on one line.
"""

import socket
import sys


def free_port(address=""):
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def main(argv):
    print(free_port(argv[1] if len(argv) > 1 else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
