"""Graphs scale: building and writing do a bounded amount of work per node.

Counted, not timed: every iteration over ``Graph.values`` is counted, and doubling the
nodes must at most double the count (benchmarks/perf.py times 10k to 100k nodes).
"""

from __future__ import annotations

import numpy as np
import pytest

from xnnquant.graph import Graph


class CountingList(list):  # type: ignore[type-arg]
    """A list that counts the elements visited by iteration."""

    visited = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        CountingList.visited += len(self)
        return super().__iter__()


def chain(n: int) -> Graph:
    """n nodes in a chain, an external output every 4th node: the shape xq.verify builds."""
    g = Graph()
    g.values = CountingList()
    x = g.input((1, 8))
    for i in range(n):
        x = g.negate(x) if i % 2 else g.add(x, g.constant(np.full((1, 8), i, np.float32)))
        if i % 4 == 3:
            g.output(x)
            x = g.negate(x)
    g.output(x)
    return g


@pytest.mark.parametrize("n", [800])
def test_building_and_writing_visit_each_value_a_bounded_number_of_times(n: int) -> None:
    """Twice the nodes, twice the work: no builder or writer step scans every value per node."""
    visits = []
    for size in (n, 2 * n):
        CountingList.visited = 0
        g = chain(size)
        g.to_bytes()
        visits.append(CountingList.visited)
    assert visits[1] <= 2.2 * visits[0], visits  # quadratic work would give 4x
    assert visits[0] <= 60 * n, visits  # a few dozen passes over the values in all, not one per node
