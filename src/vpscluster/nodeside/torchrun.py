"""torch's elastic launcher, `python -m torch.distributed.run ARGS`, with its stores bound.

torch's TCPStore server listens on every interface whatever host it is given: the c10d
rendezvous store on the head, and the store rank 0's agent shares with its workers. torchrun has
no flag to change that, and the store accepts anyone (no authentication). So each store server
is handed a socket bound to the address it was asked for (TCPStore's `master_listen_fd`): the
rendezvous endpoint on the head, the node's --local-addr for the shared store. Where that address
is not the node's own (a provider's 1:1 NAT), torch does as it always did (the firewall then
closes the port); a host name is left to torch too (the launcher always gives addresses).

And the c10d rendezvous polls its store every `SYNC_POLL_S` instead of every second: a node that
joined waits for the last one by re-reading the rendezvous state after a fixed 1 s pause
(`dynamic_rendezvous._delay(seconds=1)`), so every launch lost up to a second (half on average)
before its workers started, and again on every restart; a small store read five times a second
is nothing for the head.

    torchrun.py ARGS...     exactly torchrun's arguments
"""

import ipaddress
import socket
import sys

SYNC_POLL_S = 0.2


def bound_store(base):
    """A TCPStore class whose servers listen on their host address only."""

    class BoundTCPStore(base):
        def __init__(self, host_name, port, world_size=None, is_master=False, *args, **kwargs):
            try:
                ip = ipaddress.ip_address(host_name)
            except ValueError:
                ip = None
            if (is_master and ip is not None and not ip.is_unspecified and len(args) < 4
                    and kwargs.get("master_listen_fd") is None):
                sock = socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((host_name, port))
                    sock.listen(2048)
                except OSError:  # served by this process already (multi-tenant), NAT, or taken: as torch
                    sock.close()
                else:
                    port = sock.getsockname()[1]
                    kwargs["master_listen_fd"] = sock.detach()
            super().__init__(host_name, port, world_size, is_master, *args, **kwargs)

    return BoundTCPStore


def shorter_sync(delay):
    """torch's rendezvous `_delay`, with its fixed pauses (the 1 s polls) capped at SYNC_POLL_S;
    random pauses (a tuple of bounds: the first join's skew) are left as they are."""

    def _delay(seconds):
        if not isinstance(seconds, tuple):
            seconds = min(seconds, SYNC_POLL_S)
        return delay(seconds)

    return _delay


def main(argv):
    import torch.distributed as dist
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend as c10d_backend
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic

    dist.TCPStore = c10d_backend.TCPStore = bound_store(dist.TCPStore)
    if callable(getattr(dynamic, "_delay", None)):  # a private name: a torch without it is left as it is
        dynamic._delay = shorter_sync(dynamic._delay)
    from torch.distributed.run import main as torchrun

    sys.argv = ["torchrun", *argv]
    torchrun(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
