"""What a user types: ``optimize``, ``plan``, ``backend``, ``partitioner`` and the "remat"
dynamo backend. Each reads the user's options once (``Budget.parse``, ``remat.config``)
and wires the parts: the backend (``remat.backends``) and, for a module, a compiled twin
whose calls the step runner sees (``remat.runtime``)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from remat.backends import InductorPartitioner, RematBackend
from remat.cache import CacheLike, open_cache
from remat.config import budget as configured_budget
from remat.config import option
from remat.device_budget import check_available
from remat.errors import (
    EagerFallback,
    InvalidOption,
    NothingCompiled,
    RecompileLimitHit,
    RecurrentModules,
    RematError,
)
from remat.max_sizes import MaxSizes, MaxSizesLike
from remat.passes._torch_compat import (
    TRACE_CHECKPOINT_SIDE_EFFECTS,
    BackendCompilerFailed,
    ConstraintViolationError,
    FailOnRecompileLimitHit,
    dynamo_config,
    fsdp_resized_tensors,
    has_fsdp,
    profiler_range_notes_off,
    tree_flatten,
)
from remat.planner import Planner
from remat.report import PlanReport
from remat.solvers.budget import BudgetLike
from remat.solvers.solve import Solver

ON_FAILURE = ("eager", "raise")  # what optimize does where remat cannot compile a model


def backend(
    budget: BudgetLike | None = None,
    *,
    solver: str | Solver | None = None,
    compiler: str | None = None,
    cost_model: str | None = None,
    cache: CacheLike = None,
) -> RematBackend:
    """A backend for ``torch.compile(model, backend=remat.backend(budget=...))``. Options
    not given come from ``remat.configure`` or ``REMAT_*`` variables (``remat.config``);
    ``cache``: ``remat.cache.open_cache``."""
    parsed = configured_budget(budget)
    check_available(parsed)
    return RematBackend(
        parsed,
        solver=option("solver", solver),
        compiler=option("compiler", compiler),
        cost_model=option("cost_model", cost_model),
        cache=open_cache(cache),
    )


def partitioner(
    budget: BudgetLike | None = None,
    *,
    solver: str | Solver | None = None,
    cost_model: str | None = None,
    cache: CacheLike = None,
) -> InductorPartitioner:
    """A ``CustomPartitionerFn`` for ``torch._inductor.config.custom_partitioner_fn``."""
    parsed = configured_budget(budget)
    check_available(parsed)
    planner = Planner(
        parsed,
        solver=option("solver", solver),
        cost_model=option("cost_model", cost_model),
        compiler="inductor",
        cache=open_cache(cache),
    )
    return InductorPartitioner(planner)


def _dynamo_backend_entry(gm, example_inputs, *, options: dict | None = None, mode=None):
    """Entry point for ``torch.compile(model, backend="remat", options={"budget": ...})``;
    without ``options``, ``remat.configure`` or ``REMAT_*`` variables give them."""
    return backend(**dict(options or {}))(gm, example_inputs)


def optimize(
    model: nn.Module | Callable,
    budget: BudgetLike | None = None,
    *,
    solver: str | Solver | None = None,
    compiler: str | None = None,
    cost_model: str | None = None,
    cache: CacheLike = None,
    on_failure: str = "eager",
    dynamic: bool | None = None,
    max_sizes: MaxSizesLike | None = None,
) -> nn.Module | Callable:
    """Return ``model`` compiled so each training step peaks under ``budget``.

    A module's result shares everything with ``model`` but its compiled ``forward``
    (parameters, buffers, submodules, ``state_dict`` keys, ``training``), so an optimizer
    built on either trains both and ``model.eval()`` switches both. Planning happens at
    the first call, like ``torch.compile``, and the whole step is planned as one at the
    end of the first (``remat.runtime``); ``result.remat.report()`` shows what was decided.

    Args:
        model: an ``nn.Module`` whose forward returns the loss (or outputs a loss is
            computed from), or a function, as ``torch.compile`` takes: a function that
            computes the loss (``lambda x, y: F.cross_entropy(net(x), y)``) puts the loss
            in the plan.
        budget: the cap on the step's peak bytes above what is resident before it:
            ``int`` bytes (4096 or more: a smaller one is refused as ambiguous), a
            ``float`` fraction in (0, 1] of the store-all plan's peak (or, where lower, of
            your own checkpointed program's or, under ``auto``, torch's partition's), a
            string (``"2GiB"``, ``"40%"``), ``"min"`` (the lowest peak remat can reach)
            or ``"device"`` (what the CUDA device has free at the first step, less a 10%
            margin: ``remat.device_budget``); read once by ``Budget.parse``.
        solver: a name from ``remat.solvers.SOLVERS`` (default ``"auto"``) or a callable
            ``(problem, limit) -> Plan`` (``remat.solvers.Solver``).
        compiler: what runs the planned programs: ``"eager"`` (default), op by op, or
            ``"inductor"``, which compiles each (fusing kernels inside remat's schedule).
        cost_model: ``"roofline"`` (default) or ``"profile"`` (kernels timed).
        cache: the plan cache on disk (``remat.cache``): None for the default (on unless
            ``REMAT_CACHE=0``), False off, or a folder.
        dynamic: as ``torch.compile`` takes it. None (default): the first call is traced
            at its sizes, and where a later call's sizes differ the graph is traced once
            more with those sizes symbolic, then serves every size; True: symbolic from
            the first call; False: every new size traced and planned anew. A graph with
            symbolic sizes is planned at the largest sizes it has run at, and planned
            again (no trace) when larger ones come (docs/guide.md, "Sizes that vary").
        max_sizes: the largest sizes of the inputs whose sizes vary, per argument name
            (positional ones by their name in the signature): a maximum shape with None
            where a dimension does not vary, ``{"input_ids": (8, 512)}``, or dimension ->
            maximum, ``{"input_ids": {1: 512}}``. Those dimensions are symbolic from the
            first call, so the model is traced once, and planned once, at the maxima: no
            step up to them plans again, and a fraction of the budget is of the store-all
            peak at the maxima. A training call above a maximum raises
            ``SizeAboveMaximum`` before anything runs (docs/guide.md, "A declared
            maximum").
        on_failure: where remat cannot compile the model (a bug, an op it cannot plan;
            not a verdict such as ``InfeasibleBudget``, which is raised), ``"eager"``
            runs it eagerly from then on with one ``remat.errors.EagerFallback`` warning,
            ``"raise"`` raises. Only before any of remat's programs ran in that call:
            after, a rerun would update buffers twice, so it raises either way.

    Options not given come from ``remat.configure`` or ``REMAT_*`` variables
    (``remat.config``).

    Returns:
        The compiled module (or function), with ``.remat``: the ``RematBackend`` whose
        ``report()`` is a ``PlanReport``.

    Raises:
        InfeasibleBudget: at the end of the first step, where no plan of the step fits
            the budget; it names the lowest budget remat found a plan under.
        InvalidOption: a budget, solver, compiler, cost model or ``max_sizes`` it cannot
            read.
        SizeAboveMaximum: a training call's input is larger than ``max_sizes`` declares.

    Example:
        >>> import torch, remat
        >>> net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(),
        ...                           torch.nn.Linear(256, 256), torch.nn.GELU())
        >>> step = remat.optimize(lambda x: net(x).square().mean(), budget=0.8, cache=False)
        >>> x = torch.randn(512, 256)
        >>> for _ in range(2):
        ...     step(x).backward()
        >>> report = step.remat.report()
        >>> report.predicted_peak <= report.steps[0].limit
        True
    """
    if on_failure not in ON_FAILURE:
        raise InvalidOption(f"on_failure must be one of {ON_FAILURE}, got {on_failure!r}")
    if max_sizes and dynamic is False:
        raise InvalidOption(
            "max_sizes makes the declared sizes symbolic, which dynamic=False forbids: "
            "leave dynamic at None (or True)"
        )
    rb = backend(budget, solver=solver, compiler=compiler, cost_model=cost_model, cache=cache)
    if isinstance(model, nn.Module):
        # ``optimized.remat`` is ``rb``
        return _compiled_copy(model, rb, on_failure, dynamic, max_sizes)
    if not callable(model):
        raise TypeError(f"optimize expects an nn.Module or a function, got {type(model).__name__}")
    name = getattr(model, "__qualname__", type(model).__name__)
    declared = MaxSizes.parse(max_sizes, model, name)
    compiled = _guarded(
        torch.compile(model, backend=rb, dynamic=dynamic), rb, name, model, on_failure,
        declared=declared,
    )  # fmt: skip
    functools.update_wrapper(compiled, model)
    compiled.remat = rb
    return compiled


def _compiled_copy(
    model: nn.Module,
    rb: RematBackend,
    on_failure: str,
    dynamic: bool | None = None,
    max_sizes: MaxSizesLike | None = None,
) -> nn.Module:
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
    name = f"{cls.__name__}.forward"
    compiled = _guarded(
        torch.compile(model.forward, backend=rb, dynamic=dynamic),
        rb,
        name,
        model.forward,
        on_failure,
        recurrent=_recurrent(model),
        declared=MaxSizes.parse(max_sizes, model.forward, name),
    )

    @functools.wraps(cls.forward)
    def forward(self, *args, **kwargs):
        return compiled(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        rb.before_first_step(model, args, kwargs)  # the program as given, under fake tensors
        rb.steps.entering((args, kwargs))  # before the hooks: FSDP's all-gathers are the step's
        return nn.Module.__call__(self, *args, **kwargs)

    def __deepcopy__(self, memo):
        # A copy's forward would still run ``model`` (``compiled`` is bound to it).
        raise TypeError(
            f"a remat-optimized {cls.__name__} cannot be deep-copied (the copy would still "
            "run the original's parameters): deep-copy the original module, and optimize "
            "the copy if it should be optimized too"
        )

    names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    members = {"forward": forward, "remat": rb, "__call__": __call__, "__deepcopy__": __deepcopy__}
    twin_class = type(cls.__name__, (cls,), {**names, **members})
    optimized = object.__new__(twin_class)
    object.__setattr__(optimized, "__dict__", model.__dict__)
    # FSDP2's hooks all-gather before the first graph, by resizing storages. DDP hands what
    # its forward allocates before the first graph (its buffers' broadcast) to gloo's
    # threads, which free it; a storage remat counts has a Python object whose release
    # there takes the GIL (2 ranks hung 2 runs in 12 counting it, none in 8 not). It holds
    # nothing past the call.
    rb.steps.serve(
        resized=functools.partial(fsdp_resized_tensors, model) if has_fsdp(model) else None,
        from_call=not any(isinstance(m, DistributedDataParallel) for m in model.modules()),
    )
    return optimized


def _recurrent(model: nn.Module) -> list[str]:
    """The ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` modules in ``model``'s tree, named as
    ``named_modules`` names them, with their type."""
    return [
        f"{type(m).__name__} {name or '(the model)'}"
        for name, m in model.named_modules()
        if isinstance(m, nn.RNNBase)
    ]


def _guarded(
    compiled: Callable,
    rb: RematBackend,
    name: str,
    eager: Callable,
    on_failure: str,
    recurrent: Sequence[str] = (),
    declared: MaxSizes | None = None,
) -> Callable:
    """``compiled`` raising what the user must fix, never running eagerly unplanned but
    where remat failed to compile and ``on_failure`` says so (``optimize``). A training
    call of a module holding ``recurrent`` modules is refused before it runs where dynamo
    would run them eagerly (``RecurrentModules``); one whose inputs exceed the ``declared``
    maxima too (``SizeAboveMaximum``), and the others have their declared dimensions
    marked symbolic up to them."""
    dynamo = dynamo_config
    fell_back = False

    def run(*args, **kwargs):
        nonlocal fell_back
        if fell_back:
            return eager(*args, **kwargs)
        if recurrent and not dynamo.allow_rnn and torch.is_grad_enabled():
            raise RecurrentModules(name, list(recurrent))
        if declared is not None and torch.is_grad_enabled():
            declared.apply(args, kwargs)
        rb.steps.entering((args, kwargs))
        ran = rb.steps.forwards_run
        try:
            # Past its recompile limit dynamo would run the step eagerly, outside the
            # budget, with only a log warning: fail instead (unless errors are suppressed,
            # which dynamo does not allow together with this).
            fail = not dynamo.suppress_errors
            patch = dict(fail_on_recompile_limit_hit=fail, **TRACE_CHECKPOINT_SIDE_EFFECTS)
            with dynamo.patch(**patch), profiler_range_notes_off():
                out = compiled(*args, **kwargs)
        except BackendCompilerFailed as failure:
            # A budget or option error is the user's to fix: show it, not dynamo's wrapper.
            inner = failure.inner_exception
            if isinstance(inner, RematError):
                raise inner from None
            if on_failure == "raise" or rb.steps.forwards_run != ran:
                raise
            warnings.warn(
                f"remat could not compile {name} ({type(inner).__name__}: "
                f"{' '.join(str(inner).split())[:300]}); it runs eagerly from now on, "
                "unplanned and outside the budget. optimize(..., on_failure='raise') makes "
                "this an error.",
                EagerFallback,
                stacklevel=2,
            )
            fell_back = True
            return eager(*args, **kwargs)
        except FailOnRecompileLimitHit as hit:
            raise RecompileLimitHit(name, dynamo.recompile_limit) from hit
        except ConstraintViolationError as violation:
            if declared is None:
                raise
            raise InvalidOption(
                f"max_sizes: {name} does not take every size up to the declared maxima "
                f"(its code limits them; dynamo: {' '.join(str(violation).split())}). "
                "Declare maxima the model takes: the guard above says where its code limits "
                "the size (a position table or a mask built for a length)"
            ) from None
        if not rb.compiles:  # dynamo skipped the whole frame: it will at every call
            raise NothingCompiled(name)
        rb.steps.returned()
        return out

    return run


def plan(
    model: nn.Module,
    example_inputs: Sequence,
    budget: BudgetLike | None = None,
    *,
    solver: str | Solver | None = None,
    cost_model: str | None = None,
    cache: CacheLike = None,
    example_kwargs: Mapping[str, Any] | None = None,
    max_sizes: MaxSizesLike | None = None,
) -> PlanReport:
    """Plan ``model``'s training step on ``example_inputs`` without training it.

    Runs one step: the forward, and a backward from its output (a loss; from a non-scalar
    output, a gradient of ones), so the step is planned as one. Buffers the forward
    updates (BatchNorm statistics) and the parameters' ``.grad`` are restored afterwards.

    Args:
        model: the module to plan.
        example_inputs: positional inputs of one step.
        budget, solver, cost_model, cache: as ``optimize`` takes them.
        example_kwargs: keyword inputs of one step (Hugging Face models take
            ``input_ids=``, ``labels=``).
        max_sizes: as ``optimize`` takes it: the step is planned at these maxima, from
            example inputs no larger.

    Returns:
        A ``PlanReport``: every graph's plan and the step's joint plan, printable as a
        table.

    Raises:
        InfeasibleBudget: no plan of the step fits the budget; it names the lowest budget
            remat found a plan under.

    Example:
        >>> import torch, remat
        >>> layer = lambda: torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU())
        >>> net = torch.nn.Sequential(*[layer() for _ in range(4)])
        >>> report = remat.plan(net, (torch.randn(512, 256),), budget=0.8, cache=False)
        >>> report.predicted_peak <= 0.8 * report.store_all_peak
        True
    """
    rb = backend(budget, solver=solver, compiler="eager", cost_model=cost_model, cache=cache)
    # a plan or an error, not eager
    traced = _compiled_copy(model, rb, on_failure="raise", max_sizes=max_sizes)
    snapshot = {k: v.detach().clone() for k, v in model.named_buffers()}
    grads = {p: p.grad for p in model.parameters()}
    try:
        out = traced(*example_inputs, **(example_kwargs or {}))
        roots = [t for t in tree_flatten(out)[0] if _differentiable(t)]
        if roots:
            torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    finally:
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(snapshot[k])
        for p, g in grads.items():
            p.grad = g
        torch.compiler.reset()
    return rb.report()


def _differentiable(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
