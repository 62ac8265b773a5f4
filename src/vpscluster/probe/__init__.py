"""Probe: know every node and every link before training on them (`vpscluster probe`).

    api.py            run_probe / run_probe_async: the stages below, then problems, then save
    facts.py          node facts gathered in parallel  (runs facts_script.py on each node)
    links.py          RTT + bandwidth, round-robin schedule (runs link_script.py on the nodes)
    collectives.py    all-reduce sweep and α–β fit     (runs allreduce_script.py on the nodes)
    problems.py       rules: measurements -> problems with fixes; blocking_problems
    store.py          where probe.json lives; load_probe
    report.py         the rich report for people
    remote.py         how a self-contained script is shipped inside `python -c`

The *_script.py files run on the nodes with the node's own Python: standard library only
(plus torch where the node has it), never an import of vpscluster.
"""
