"""Every error remat raises on a user's request rather than from a bug in itself.

Each is a ``RematError`` (the CLI and the bench report those as one line, by type) and
also the builtin a caller would catch (``ValueError``, ``RuntimeError``). The budget and
solver errors come from ``remat.solvers`` (which has no torch); the rest need torch's
compile stack to arise.
"""

from __future__ import annotations

from remat.solvers.errors import InfeasibleBudget, InvalidOption, RematError, SolverOverBudget
from remat.solvers.schedule import InvalidPlan

__all__ = [
    "EagerFallback",
    "InfeasibleBudget",
    "InvalidOption",
    "InvalidPlan",
    "NothingCompiled",
    "RecompileLimitHit",
    "RecurrentModules",
    "RematError",
    "SizeAboveMaximum",
    "SolverOverBudget",
    "user_error",
]


def user_error(exc: BaseException) -> RematError | None:
    """The ``RematError`` behind ``exc`` (dynamo wraps a backend's errors in its own), or
    None when ``exc`` comes from a bug."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, RematError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


class EagerFallback(UserWarning):
    """remat could not compile a model, which then runs eagerly: unplanned, outside the
    budget (``optimize(..., on_failure="raise")`` makes it an error instead)."""


class NothingCompiled(RematError, RuntimeError):
    """dynamo captured no graph from the forward and ran it eagerly, outside the budget."""

    def __init__(self, model_name: str) -> None:
        super().__init__(
            f"remat planned nothing for {model_name}: torch.compile captured no graph "
            "from it and ran it eagerly, outside remat's budget. TORCH_LOGS=graph_breaks "
            "names the reason (a function calling an nn.LSTM, nn.GRU or nn.RNN, for one, "
            "unless torch._dynamo.config.allow_rnn = True)."
        )


class RecurrentModules(RematError, RuntimeError):
    """The module holds ``nn.LSTM``, ``nn.GRU`` or ``nn.RNN`` modules, which dynamo runs
    eagerly unless ``allow_rnn``: outside any plan. Refused at the first call, before
    anything runs, on every torch: 2.14 and earlier skip the whole forward (which raised
    ``NothingCompiled`` after it ran), 2.15 breaks the graph at the module's call and
    compiles the rest, so the recurrent module runs as code outside remat's programs (an
    LSTM's kernel scratch, which remat cannot count there, made such a step peak at 1.7x
    its prediction)."""

    def __init__(self, model_name: str, modules: list[str]) -> None:
        super().__init__(
            f"remat cannot plan {model_name}: it holds {', '.join(modules)}, which "
            "torch.compile runs eagerly unless torch._dynamo.config.allow_rnn = True, "
            "outside remat's budget. Set allow_rnn: a GRU then trains under remat; an "
            "LSTM fails in torch's own AOT autograd on CPU (torch 2.11 to 2.15, "
            "aot_eager too).",
        )


class RecompileLimitHit(RematError, RuntimeError):
    """dynamo's recompile limit stopped remat from planning a step, which would otherwise
    have run eagerly, outside the budget."""

    def __init__(self, model_name: str, limit: int) -> None:
        super().__init__(
            f"torch.compile hit dynamo's recompile limit ({limit}) on {model_name}, "
            "so this step would run eagerly, outside remat's budget. Every remat.optimize "
            f"of a {model_name} in one process compiles that forward once more, and so "
            "does a guard the code puts on sizes or values (a Python branch on a size; "
            "TORCH_LOGS=recompiles names each), or every new input shape under "
            "optimize(..., dynamic=False). Raise torch._dynamo.config.recompile_limit, call "
            "torch.compiler.reset() before optimizing another model (earlier ones then plan "
            "again at their next call), or let sizes vary symbolically (dynamic=None)."
        )


class SizeAboveMaximum(RematError, ValueError):
    """A training call's input is larger than ``optimize(..., max_sizes=...)`` declared.
    Refused before anything runs: the plan, and a fraction of the budget, were made for
    the declared maxima, and dynamo would trace the call again (its guards check them)."""

    def __init__(self, name: str, dim: int, size: int, maximum: int) -> None:
        self.name, self.dim, self.size, self.maximum = name, dim, size, maximum
        super().__init__(
            f"{name} has size {size} at dimension {dim}, above its declared maximum "
            f"{maximum} (optimize(..., max_sizes=...)): declare a maximum of at least "
            f"{size} for it (the model is then traced and planned once, at the new "
            "maxima), or cut the batch to the maximum"
        )
