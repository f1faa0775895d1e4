"""The ``torch.compile`` backend: each graph dynamo compiles is planned (``Planner``) and
run step by step (``remat.runtime``); and ``remat.partitioner``'s adapter, which plans
inside inductor's own compile."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from remat.as_given import eager_phases
from remat.cache import PlanCache
from remat.compiled import CompiledGraph, GraphPlan, Leaves
from remat.costs import COMPILERS  # what runs remat's fw/bw programs; the first is the default
from remat.errors import InvalidOption
from remat.passes._torch_compat import (
    CompileContext,
    aot_autograd,
    boxed,
    custom_partitioner_base,
    declared_maxima,
    dynamo_compiled_code,
    inductor_decompositions,
    inductor_program,
)
from remat.passes.sizes import Sizes, describe, guard_at_most
from remat.planner import Planner
from remat.report import PlanReport
from remat.runtime import StepRunner
from remat.runtime.programs import add_marker_slot
from remat.solvers import format_bytes
from remat.solvers.budget import Budget
from remat.solvers.solve import Solver

log = logging.getLogger("remat")


class RematBackend:
    """A ``torch.compile`` backend that plans each graph with a ``Planner`` as it is
    compiled and each step as one (``remat.runtime``).

    ``compiler="eager"`` runs the rewritten fx programs as plain Python (the
    schedule is exactly the plan's); ``"inductor"`` compiles each program with inductor,
    which fuses kernels inside it. ``budget`` is parsed already (``Budget.parse``, at
    the API).
    """

    def __init__(
        self,
        budget: Budget,
        *,
        solver: str | Solver = "auto",
        compiler: str = "eager",
        cost_model: str = "roofline",
        cache: PlanCache | None = None,
    ) -> None:
        if compiler not in COMPILERS:
            raise InvalidOption(f"compiler must be one of {COMPILERS}, got {compiler!r}")
        self.compiler = compiler
        self.compiles = 0  # graphs dynamo handed over: none means it ran everything eagerly
        self.cache = cache  # ``remat.cache``; None when off
        self.planner = Planner(
            budget,
            solver=solver,
            cost_model=cost_model,
            compiler=compiler,
            cache=cache,
            joint_follows=True,
        )
        self.steps = StepRunner(budget, solver, cache, replan=self.planner.replan)
        # (dynamo frame, input name) -> the largest sizes its traces had (``_largest_seen``)
        self._largest: dict[tuple, tuple] = {}
        self._eager_run = False  # ``before_first_step`` ran the module's eager step

    @property
    def graphs(self) -> list[GraphPlan]:
        return self.planner.graphs

    def before_first_step(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Before the first training call of ``module`` compiles: its eager step run under
        fake tensors (``as_given.eager_phases``), so a fraction of the budget is of at most
        the program as given, where the module compiles to one graph at these sizes. Only
        for a fraction (bytes and ``"min"`` do not depend on it), not across ranks (the
        module's hooks would run collectives on fake tensors), and not under inductor:
        remat counts inductor's decomposed ops one by one where its kernels fuse them, so
        the eager step's peak would refuse budgets inductor fits (a 64-wide MLP at 1.0:
        its lowest peak counted 41,996 B against the eager step's 27.1 KiB)."""
        budget = self.planner.budget
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        skipped = budget.fraction is None or distributed or self.compiler == "inductor"
        if self._eager_run or skipped:
            return
        if not torch.is_grad_enabled():  # not a training call: the next one may be
            return
        self._eager_run = True
        start = time.perf_counter()
        with self.steps.paused():
            self.planner.as_given = eager_phases(module, args, kwargs)
        if self.planner.as_given is not None:
            log.info(
                "remat: the module's eager step, run under fake tensors in %.1fs, peaks at %s",
                time.perf_counter() - start,
                format_bytes(max(self.planner.as_given.forward, self.planner.as_given.backward)),
            )

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor]):
        self.compiles += 1
        compile_id = CompileContext.current_compile_id()
        if compile_id is not None and compile_id.frame_compile_id:
            log.info(
                "remat: dynamo compiles a forward again (compile %s): a guard on its input "
                "sizes or values failed, or another model runs the same code; where sizes "
                "changed, the new graph has them symbolic and serves every size from now on "
                "(TORCH_LOGS=recompiles: why)",
                compile_id,
            )
        leaves = _leaves_needing_grad(example_inputs)
        declared = [declared_maxima(value) for value in example_inputs]
        seen = self._largest_seen(gm, example_inputs, compile_id, declared)
        with self.steps.paused():  # planning mid-step allocates; the user's code did not
            return self._compile(gm, example_inputs, leaves, seen)

    def _largest_seen(
        self, gm, example_inputs, compile_id, declared: Sequence[dict[int, int]]
    ) -> list[tuple | None]:
        """Per input of ``gm``, the largest sizes (or value, for a size) the traces of its
        frame have had there so far, this one's included, each dimension with a
        ``declared`` maximum at that maximum (``optimize(..., max_sizes=...)``): a graph
        traced with symbolic sizes is planned at least at the sizes its static trace ran
        at, and at the declared maxima (``Sizes.hints``). Inputs are matched by dynamo's
        names for them (a symbolic trace adds size inputs, so positions shift)."""
        frame = None if compile_id is None else compile_id.frame_id
        names = [p.name for p in gm.graph.find_nodes(op="placeholder")]
        seen = []
        for name, value, maxima in zip(names, example_inputs, declared, strict=False):
            key, now = (frame, name), _concrete(value)
            if now is not None and maxima:
                now = tuple(maxima.get(d, size) for d, size in enumerate(now))
            earlier = self._largest.get(key, now)
            if now is not None and len(earlier) == len(now):
                self._largest[key] = tuple(
                    max((v for v in pair if v is not None), default=None)
                    for pair in zip(now, earlier, strict=True)
                )
            seen.append(self._largest.get(key))
        return seen

    def _compile(self, gm, example_inputs, leaves: Leaves, seen: list):
        """AOTAutograd with remat's partition: the graph it plans goes to the step runner,
        whose forward and backward run its programs (compiled by inductor under
        ``compiler="inductor"``, the graph traced with inductor's decompositions then, so
        remat plans the ops inductor runs: planned on the ops they replace, T5 measured
        1.25x its budget). The runner takes the graph when its forward is compiled, not at
        the partition: AOTAutograd may edit the programs in between (effect tokens,
        saved-tensors hooks), and they must be read as they will run."""
        inductor = self.compiler == "inductor"
        planned: list[CompiledGraph] = []  # the graph of this compile, if it needs gradients
        alone = self.steps.starting() and _ends_its_frame(gm)
        unseen = _resumes_eagerly()
        log.info("remat: tracing the backward of a %d-node forward...", len(gm.graph.nodes))
        tracing = time.perf_counter()

        def partition(joint, _joint_inputs, *, num_fwd_outputs: int, **_ignored):
            log.info(
                "remat: forward and backward traced in %.1fs: %d nodes",
                time.perf_counter() - tracing,
                len(joint.graph.nodes),
            )
            compiled = self.planner.plan(
                joint, num_fwd_outputs, leaves=leaves, held=self.steps.held_now(), seen=seen,
                held_stored=self.steps.held_now(stored=True),
                stored_peak=self.steps.stored_peak(), alone=alone, unseen=unseen,
            )  # fmt: skip
            self.steps.budget = self.planner.budget  # "device" is bytes once planned
            add_marker_slot(compiled.forward, compiled.backward, num_fwd_outputs)
            planned.append(compiled)
            return compiled.forward, compiled.backward

        def compile_forward(program: torch.fx.GraphModule, _inputs):
            if not planned:  # an inference graph (no gradient needed): nothing planned
                return inductor_program(program, inference=True) if inductor else boxed(program)
            return self.steps.forward(self.steps.add(planned[-1]))

        def compile_backward(_program: torch.fx.GraphModule, _inputs):
            return self.steps.backward(self.steps.graphs[planned[-1].record.name])

        return aot_autograd(
            fw_compiler=compile_forward,
            bw_compiler=compile_backward,
            partition_fn=partition,
            **({"decompositions": inductor_decompositions()} if inductor else {}),
        )(gm, example_inputs)

    def report(self) -> PlanReport:
        return PlanReport(tuple(self.planner.graphs), tuple(self.steps.plans))


def _ends_its_frame(gm: torch.fx.GraphModule) -> bool:
    """Whether dynamo compiled ``gm`` at its frame's return, not at a graph break (after
    which more of the frame runs, in graphs of its own)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    return reason is not None and not reason.graph_break


def _resumes_eagerly() -> bool:
    """Whether a model frame (code that is neither torch's nor remat's) is paused between a
    call of a module or function ``remat.optimize`` returned and the frame dynamo compiles
    now, running its own code, not bytecode dynamo compiled: it runs on eagerly when the
    compiled frame returns, code no graph of the step holds (FSDP2's root module, which
    dynamo skips, between its blocks). A frame dynamo compiled and broke at a call (its
    rest resumes in graphs of its own) is not one. False where no such call is on the
    stack (the backend handed to ``torch.compile`` directly)."""
    frame = sys._getframe(1)
    while frame is not None and _is_file(frame, _REMAT):  # the backend's own frames
        frame = frame.f_back
    found = False
    while frame is not None:
        if frame.f_code.co_filename == _API:
            return found  # the optimized call: the frames between are the model's
        found = found or not (_is_file(frame, _TORCH) or dynamo_compiled_code(frame.f_code))
        frame = frame.f_back
    return False


_TORCH = str(Path(torch.__file__).parent) + os.sep
_REMAT = str(Path(__file__).parent) + os.sep
_API = str(Path(__file__).with_name("api.py"))


def _is_file(frame, folder: str) -> bool:
    return frame.f_code.co_filename.startswith(folder)


def _concrete(value) -> tuple[int | None, ...] | None:
    """An input's sizes as numbers (None for a symbolic one), or a size input's value."""
    if isinstance(value, torch.Tensor):
        return tuple(None if isinstance(s, torch.SymInt) else int(s) for s in value.shape)
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    return None


def _leaves_needing_grad(inputs: Sequence) -> Leaves:
    """Per input, (identity, bytes) where autograd accumulates a gradient into it (a
    parameter, an input needing a gradient), else None: ``GraphPlan.leaves``."""
    return tuple(
        (id(t), t.numel() * t.element_size())
        if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad
        else None
        for t in inputs
    )


class InductorPartitioner(custom_partitioner_base()):
    """Adapter for ``torch._inductor.config.custom_partitioner_fn``: plans each joint graph
    with what earlier frames of the step hold (remat sees no runs as inductor's
    partitioner). A graph with symbolic sizes serves every size up to those it was planned
    at; dynamo traces and plans it again past them."""

    def __init__(self, planner: Planner):
        self.planner = planner

    def __call__(self, gm, joint_inputs, *, num_fwd_outputs: int, **_ignored):
        held = self.planner.held_by_earlier_frames()
        compiled = self.planner.plan(gm, num_fwd_outputs, held=held)
        if growing := Sizes.of(gm).unbounded(()):
            guard_at_most(gm, compiled.binding, growing)
            log.info(
                "remat %s: planned at %s, serving every size up to it; a larger one "
                "traces and plans again",
                compiled.record.name,
                describe(compiled.binding),
            )
        return compiled.forward, compiled.backward

    def __deepcopy__(self, memo):
        # inductor snapshots its config by deep copy; the planner and its plans are
        # shared state, not configuration.
        return self

    def uuid(self):
        return f"remat-{self.planner.budget}-{self.planner.solver}-{self.planner.cost_model}"
