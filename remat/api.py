"""What a user types: ``optimize``, ``plan``, ``backend`` and the "remat" dynamo backend."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tabulate import tabulate
from torch import nn
from torch._dynamo.exc import BackendCompilerFailed, FailOnRecompileLimitHit

from remat.passes._torch_compat import boxed
from remat.planner import GraphPlan, Planner, held_before, step_peak
from remat.runs import RunTracker
from remat.solvers import InfeasibleBudget, format_bytes
from remat.solvers.budget import Budget
from remat.solvers.solve import Solver

COMPILERS = ("eager", "inductor")


class RematBackend:
    """A ``torch.compile`` backend that plans each graph with a ``Planner``.

    ``compiler="eager"`` runs the rewritten fx programs as plain Python (the
    schedule is exactly the plan's); ``"inductor"`` hands remat's partition to
    inductor, which fuses kernels inside it (peak then tracks, not equals, the
    prediction).
    """

    def __init__(
        self,
        budget: Budget,
        *,
        solver: str | Solver = "auto",
        compiler: str = "eager",
        cost_model: str = "roofline",
    ) -> None:
        if compiler not in COMPILERS:
            raise ValueError(f"compiler must be one of {COMPILERS}, got {compiler!r}")
        self.compiler = compiler
        self.compiles = 0  # graphs dynamo handed over: none means it ran everything eagerly
        self.planner = Planner(budget, solver=solver, cost_model=cost_model)
        # warns when a graph runs twice in a step, or its loss is computed outside it
        self.runs = RunTracker(self.planner.warn_if_loss_outside)

    @property
    def graphs(self) -> list[GraphPlan]:
        return self.planner.graphs

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor]):
        self.compiles += 1
        self.planner.next_leaves = _leaves_needing_grad(example_inputs)
        if self.compiler == "inductor":
            from torch._functorch import config as functorch_config
            from torch._inductor import config
            from torch._inductor.compile_fx import compile_fx

            # Caches would skip the partitioner on a hit, leaving no plan to report.
            with (
                config.patch(
                    custom_partitioner_fn=InductorPartitioner(self.planner), fx_graph_cache=False
                ),
                functorch_config.patch(enable_autograd_cache=False),
            ):
                return compile_fx(gm, example_inputs)
        from torch._dynamo.backends.common import aot_autograd

        def compile_forward(program: torch.fx.GraphModule, _inputs):
            return boxed(program)

        def compile_backward(program: torch.fx.GraphModule, _inputs):
            return self.runs.after_backward(boxed(program), program.meta["remat"])

        planned = len(self.planner.graphs)
        compiled = aot_autograd(
            fw_compiler=compile_forward, bw_compiler=compile_backward, partition_fn=self.planner
        )(gm, example_inputs)
        if len(self.planner.graphs) == planned:  # an inference graph: nothing planned
            return compiled
        return self.runs.watch(compiled, self.planner.graphs[-1].name)

    def report(self) -> PlanReport:
        return PlanReport(tuple(self.planner.graphs))


def _leaves_needing_grad(inputs: Sequence) -> frozenset[tuple[int, int]]:
    """(identity, bytes) of the inputs autograd accumulates a gradient into (parameters):
    ``GraphPlan.leaves``."""
    return frozenset(
        (id(t), t.numel() * t.element_size())
        for t in inputs
        if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad
    )


def _inductor_partitioner_base():
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    return CustomPartitionerFn


class InductorPartitioner(_inductor_partitioner_base()):
    """Adapter for ``torch._inductor.config.custom_partitioner_fn``."""

    def __init__(self, planner: Planner) -> None:
        self.planner = planner

    def __call__(self, gm, joint_inputs, **kwargs):
        kwargs.pop("compiler", None)
        return self.planner(gm, joint_inputs, **kwargs)

    def __deepcopy__(self, memo):
        # inductor snapshots its config by deep copy; the planner and its plans are
        # shared state, not configuration.
        return self

    def uuid(self):
        return f"remat-{self.planner.budget}-{self.planner.solver}-{self.planner.cost_model}"


def backend(
    budget: Budget,
    *,
    solver: str | Solver = "auto",
    compiler: str = "eager",
    cost_model: str = "roofline",
) -> RematBackend:
    """A backend for ``torch.compile(model, backend=remat.backend(budget=...))``."""
    return RematBackend(budget, solver=solver, compiler=compiler, cost_model=cost_model)


def partitioner(
    budget: Budget, *, solver: str | Solver = "auto", cost_model: str = "roofline"
) -> InductorPartitioner:
    """A ``CustomPartitionerFn`` for ``torch._inductor.config.custom_partitioner_fn``."""
    return InductorPartitioner(Planner(budget, solver=solver, cost_model=cost_model))


def _dynamo_backend_entry(gm, example_inputs, *, options: dict | None = None, mode=None):
    """Entry point for ``torch.compile(model, backend="remat", options={"budget": ...})``."""
    options = dict(options or {})
    if "budget" not in options:
        raise ValueError(
            'the "remat" backend needs a budget: options={"budget": "2GiB"} '
            "(or a fraction of the store-all peak, e.g. 0.5)"
        )
    return backend(**options)(gm, example_inputs)


def optimize(
    model: nn.Module,
    budget: Budget,
    *,
    solver: str | Solver = "auto",
    compiler: str = "eager",
    cost_model: str = "roofline",
) -> nn.Module:
    """Return ``model`` compiled so one training step peaks under ``budget``.

    The result shares everything with ``model`` but its compiled ``forward``
    (parameters, buffers, submodules, ``state_dict`` keys, ``training``), so an
    optimizer built on either trains both and ``model.eval()`` switches both.
    Planning happens at the first call, like ``torch.compile``;
    ``result.remat.report()`` shows what was decided.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize expects an nn.Module, got {type(model).__name__}")
    rb = backend(budget, solver=solver, compiler=compiler, cost_model=cost_model)
    optimized = _compiled_copy(model, rb)  # ``optimized.remat`` is ``rb``
    return optimized


class NothingCompiled(RuntimeError):
    """dynamo captured no graph from the forward and ran it eagerly, outside the budget."""

    def __init__(self, model_name: str) -> None:
        super().__init__(
            f"remat planned nothing for {model_name}.forward: torch.compile captured no graph "
            "from it and ran it eagerly, outside remat's budget. TORCH_LOGS=graph_breaks "
            "names the reason; nn.LSTM, nn.GRU and nn.RNN, for one, make dynamo skip the "
            "whole forward unless torch._dynamo.config.allow_rnn = True (GRU then trains "
            "under remat; LSTM fails in torch 2.13's own AOT autograd on CPU)."
        )


class RecompileLimitHit(RuntimeError):
    """dynamo's recompile limit stopped remat from planning a step, which would otherwise
    have run eagerly, outside the budget."""

    def __init__(self, model_name: str, limit: int) -> None:
        super().__init__(
            f"torch.compile hit dynamo's recompile limit ({limit}) on {model_name}.forward, "
            "so this step would run eagerly, outside remat's budget. Every remat.optimize "
            f"of a {model_name} in one process, and every new input shape, compiles that "
            "forward once more. Raise torch._dynamo.config.recompile_limit, call "
            "torch._dynamo.reset() before optimizing another model (earlier ones then plan "
            "again at their next call), or keep input shapes fixed."
        )


def _compiled_copy(model: nn.Module, rb: RematBackend) -> nn.Module:
    """A module that is ``model`` in all but its ``forward``, which is compiled with ``rb``.

    It shares ``model``'s ``__dict__`` itself, so parameters, buffers, submodules, hooks
    and plain attributes such as ``training`` are one: ``model.eval()`` switches both (a
    copy of the dict kept its own ``training`` flag, and the optimized module ran its
    training-only branch in validation). The compiled ``forward`` and ``remat`` live on a
    subclass of ``model``'s class made here, so ``model`` itself is unchanged. It is made
    without the class's ``__new__``, which FSDP2's wrapper classes override to run
    ``__init__`` again. (``nn.Module.compile`` is not used: in torch 2.13 the compiled
    ``_call_impl`` frame is skipped by dynamo and nothing is compiled.)
    """
    cls = type(model)
    if "forward" in model.__dict__:
        raise TypeError(
            f"{cls.__name__} sets forward on the instance; remat compiles the class's forward "
            "(define it on the class)"
        )
    compiled = torch.compile(model.forward, backend=rb, dynamic=False)
    dynamo = torch._dynamo.config

    @functools.wraps(cls.forward)
    def forward(self, *args, **kwargs):
        try:
            # Past its recompile limit dynamo would run the step eagerly, outside the
            # budget, with only a log warning: fail instead (unless errors are suppressed,
            # which dynamo does not allow together with this).
            with dynamo.patch(fail_on_recompile_limit_hit=not dynamo.suppress_errors):
                out = compiled(*args, **kwargs)
        except BackendCompilerFailed as failure:
            # A budget or option error is the user's to fix: show it, not dynamo's wrapper.
            if isinstance(failure.inner_exception, (InfeasibleBudget, ValueError)):
                raise failure.inner_exception from None
            raise
        except FailOnRecompileLimitHit as hit:
            raise RecompileLimitHit(cls.__name__, dynamo.recompile_limit) from hit
        if not rb.compiles:  # dynamo skipped the whole frame: it will at every call
            raise NothingCompiled(cls.__name__)
        return out

    def __deepcopy__(self, memo):
        # A copy's forward would still run ``model`` (``compiled`` is bound to it).
        raise TypeError(
            f"a remat-optimized {cls.__name__} cannot be deep-copied (the copy would still "
            "run the original's parameters): deep-copy the original module, and optimize "
            "the copy if it should be optimized too"
        )

    names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    members = {"forward": forward, "remat": rb, "__deepcopy__": __deepcopy__}
    twin_class = type(cls.__name__, (cls,), {**names, **members})
    optimized = object.__new__(twin_class)
    object.__setattr__(optimized, "__dict__", model.__dict__)
    return optimized


def plan(
    model: nn.Module,
    example_inputs: Sequence,
    budget: Budget,
    *,
    solver: str | Solver = "auto",
    cost_model: str = "roofline",
    example_kwargs: Mapping[str, Any] | None = None,
) -> PlanReport:
    """Plan ``model`` on ``example_inputs`` (and ``example_kwargs``: Hugging Face models
    take ``input_ids=``, ``labels=``) without training it.

    Tracing needs one forward pass; buffers it updates (BatchNorm statistics)
    are restored afterwards, and no gradient is computed.
    """
    rb = backend(budget, solver=solver, cost_model=cost_model)
    traced = _compiled_copy(model, rb)
    snapshot = {k: v.detach().clone() for k, v in model.named_buffers()}
    try:
        traced(*example_inputs, **(example_kwargs or {}))
    finally:
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(snapshot[k])
        torch._dynamo.reset()
    return rb.report()


@dataclass(frozen=True)
class PlanReport:
    """Plans of every graph of a model, printable as a table."""

    graphs: tuple[GraphPlan, ...]

    @property
    def predicted_peak(self) -> int:
        """The step's predicted peak: with graph breaks, each graph's plus what the other
        graphs of its step hold meanwhile (``planner.step_peak``); the largest over every
        input shape planned so far (each recompile is a step of its own)."""
        return step_peak(self.graphs, lambda g: g.plan)

    def held_before(self, graph: GraphPlan) -> int:
        """What the earlier graphs of ``graph``'s step hold while it runs."""
        return held_before(graph, self.graphs, lambda g: g.plan)

    @property
    def store_all_peak(self) -> int:
        return step_peak(self.graphs, lambda g: g.store_all)

    def rows(self) -> list[dict]:
        out = []
        for g in self.graphs:
            p, problem = g.plan, g.extracted.problem
            fwd_cost = sum(problem.nodes[i].cost for i in g.store_all.schedule.forward)
            out.append(
                {
                    "graph": g.name,
                    "compile": "-" if g.compile_id is None else str(g.compile_id),
                    "nodes": len(problem),
                    "saved": len(p.saved),
                    "saved bytes": format_bytes(g.saved_bytes),
                    "recomputed": len(p.recomputed),
                    "budget": format_bytes(g.budget),
                    "predicted peak": format_bytes(p.peak),
                    "store-all peak": format_bytes(g.store_all.peak),
                    "recompute": f"+{p.recompute_cost / max(fwd_cost, 1e-12):.1%} fwd",
                    "solver": f"{p.solver} ({p.status}"
                    + ("" if p.gap is None else f", gap {p.gap:.1%}")
                    + ")",
                    "plan time": f"{g.plan_seconds:.2f}s",
                }
            )
        return out

    def __str__(self) -> str:
        if not self.graphs:
            return "PlanReport(no graph compiled yet: call the model once)"
        return tabulate(self.rows(), headers="keys", tablefmt="simple")
