"""Probe: know every node and every link before training on them (`vpscluster probe`).

    api.py            run_probe / run_probe_async: the stages below, then problems, then save
    facts.py          node facts gathered in parallel  (runs nodeside/facts.py on each node)
    links.py          RTT + bandwidth, round-robin schedule (runs nodeside/links.py on the nodes)
    collectives.py    all-reduce sweep and α–β fit     (runs nodeside/allreduce.py on the nodes)
    problems.py       rules: measurements -> problems with fixes; blocking_problems
    store.py          where probe.json lives; load_probe
    report.py         the rich report for people

What runs on the nodes lives in `vpscluster.nodeside` (standard library only, plus torch where
the node has it, never an import of vpscluster), and is run through `nodeside.command`.
"""
