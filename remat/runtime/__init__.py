"""Run time: the programs remat compiled, run step by step, and each step planned as one.

``steps.StepRunner`` runs each graph's programs and records the first step of each kind
(``recording``), with the memory the code between them holds (``outside``, ``handed``);
``joint.plan_step`` plans the recorded step as one, and the runner swaps the programs in
from the next step on. What a graph is, the planner hands over as a
``remat.compiled.CompiledGraph`` (``StepRunner.add``).
"""

from remat.runtime.joint import StepPlan
from remat.runtime.steps import StepRunner

__all__ = ["StepPlan", "StepRunner"]
