"""The round-robin link schedule: every ordered pair exactly once, no node in two tests at once."""

import itertools

import pytest

from vpscluster.probe.links import round_robin


@pytest.mark.parametrize("n", list(range(0, 17)) + [31, 32])
def test_round_robin_covers_every_ordered_pair_once(n):
    names = [f"node-{i}" for i in range(n)]
    steps = round_robin(names)
    pairs = [p for step in steps for p in step]
    assert sorted(pairs) == sorted(itertools.permutations(names, 2))  # each direction exactly once
    for step in steps:
        busy = [x for pair in step for x in pair]
        assert len(busy) == len(set(busy)), f"a node is in two tests at once: {step}"
    # Cost linear in N: 2(N-1) steps for even N, 2N for odd N (one node rests each round).
    if n >= 2:
        assert len(steps) == (2 * (n - 1) if n % 2 == 0 else 2 * n)
        # Every step keeps all nodes busy but (for odd N) one.
        assert all(len(step) == n // 2 for step in steps)


def test_round_robin_steps_pair_directions():
    # Each round measures a->b for all its pairs, then b->a: the second step mirrors the first.
    steps = round_robin(list("abcdef"))
    for forward, backward in zip(steps[0::2], steps[1::2]):
        assert backward == [(b, a) for a, b in forward]
