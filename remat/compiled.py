"""The records compile time hands run time: ``GraphPlan``, what remat decided for one
compiled graph, and ``CompiledGraph``, that record with the programs it was rewritten
into (``Planner.plan`` returns one; ``remat.runtime`` runs it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import fx

from remat.as_given import Phases, graph_eager_peak
from remat.passes._torch_compat import CompileId
from remat.passes.extract import Extracted
from remat.passes.sizes import Binding, Sizes
from remat.solvers import Plan, saved_bytes, step_seconds

# per input of a graph, (identity, bytes) where it is a leaf autograd accumulates a gradient
# into (a parameter, an input needing a gradient), else None
Leaves = tuple[tuple[int, int] | None, ...]


@dataclass(frozen=True)
class GraphPlan:
    """What remat decided for one compiled graph, with the numbers behind it."""

    name: str
    extracted: Extracted
    plan: Plan
    store_all: Plan
    limit: int  # bytes the plan had to fit: the budget less what earlier runs held
    plan_seconds: float
    # where ``plan_seconds`` went: "extract" (costs, kernels measured), "solve", "rewrite"
    phase_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    # dynamo's id of the compile that produced this graph (None outside dynamo)
    compile_id: CompileId | None = None
    # its leaves (parameters): their gradients stay in ``.grad`` while the backwards of
    # earlier graphs of the step run
    leaves: Leaves = ()
    # the sizes it was planned at, as (symbol, value), where its sizes are symbolic
    binding: tuple[tuple[str, int], ...] = ()
    # bytes kept free of its first-step plan for the code after it (``first_step.outside_reserve``)
    reserve: int = 0
    # the room its first-step plan kept instead, for code after it that was not seen
    # (``first_step.widest_room``); None where that room is ``reserve``
    room: int | None = None
    # the plan the user's own checkpointing makes (``candidates.user_plan``), if any
    yours: Plan | None = None
    # torch's own partition as a plan (``candidates.torch_partition``), where ``auto`` made it
    theirs: Plan | None = None
    # where it is the whole forward of a module whose eager step was run under fake tensors
    # at its sizes (``remat.as_given``): that step's phases as measured (``as_measured``),
    # which a fraction is capped by
    as_given: Phases | None = None
    # whose figures its times are: "calibrated" on this machine, or the "datasheet"'s
    figures: str = "calibrated"
    # the store-all plan's peak in the graph's first step, with the room for the code
    # after it (``first_step.first_step_peak``): what later graphs of that step take as
    # the store-all step's so far (``StepRunner.stored_peak``)
    store_all_first_step: int = 0

    @property
    def eager_peak(self) -> int | None:
        """The graph's step with the module run eagerly in its place (``as_given``), where
        its eager step was run; what a fraction is of where that is lowest."""
        if self.as_given is None:
            return None
        return graph_eager_peak(self.extracted.problem, self.store_all, self.as_given)

    @property
    def saved_bytes(self) -> int:
        return saved_bytes(self.extracted.problem, self.plan)

    @property
    def step_seconds(self) -> float:
        """The estimated time of the graph's forward and backward under the plan."""
        return step_seconds(self.extracted.problem, self.plan)


@dataclass(frozen=True)
class CompiledGraph:
    """What compile time hands run time for one joint graph: the record of its plan, the
    joint graph a later plan of it is rewritten from, and the programs of this plan."""

    record: GraphPlan
    joint: fx.GraphModule
    num_fwd_outputs: int
    forward: fx.GraphModule
    backward: fx.GraphModule
    # the joint graph's size symbols (none where its sizes are static) and the sizes this
    # plan was made at: it serves every size no larger (``passes.sizes.covers``)
    sizes: Sizes = Sizes()
    binding: Binding = dataclasses.field(default_factory=dict)
    # what compiles its programs: "eager" runs them op by op, "inductor" compiles each
    # (``passes._torch_compat.inductor_program``)
    compiler: str = "eager"
