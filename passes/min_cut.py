"""torch's own partition of a joint graph, as a saved set of remat's problem.

remat keeps torch's ``min_cut_rematerialization_partition`` (at torch's default budget) as
a candidate beside its solver's plan, so it is never beaten by the partition it sits
beside under its own cost model (``solvers.solve``'s ``candidates``). The saved values are
the partitioned forward's extra outputs; those that are not nodes of the problem
(parameters, inputs, sizes) are resident anyway and drop out.
"""

from __future__ import annotations

import logging

from torch import fx

from ._torch_compat import graph_copy, min_cut_partition
from .extract import Extracted

log = logging.getLogger("remat")


def torch_saved(
    joint: fx.GraphModule, num_fwd_outputs: int, extracted: Extracted
) -> frozenset[int] | None:
    """The problem indices torch's min-cut partition of ``joint`` saves; None where the
    partitioner fails on the graph (the candidate is then simply missing)."""
    try:  # at torch's default budget, whatever a user set for torch's own compiles
        forward, _ = min_cut_partition(
            graph_copy(joint), None, memory_budget=1.0, num_fwd_outputs=num_fwd_outputs
        )
    except Exception as e:  # torch's partitioner is not ours to fix: plan without it
        log.info("remat %s: torch's partition failed (%s)", extracted.problem.name, e)
        return None
    index = {n.name: i for i, n in enumerate(extracted.problem.nodes)}
    outputs = forward.graph.output_node().args[0][num_fwd_outputs:]
    return frozenset(index[o.name] for o in outputs if isinstance(o, fx.Node) and o.name in index)
