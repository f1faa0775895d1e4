"""The methods ``remat bench`` compares, each made into what one training step calls.

- ``eager``: the model itself;
- ``checkpoint``: ``torch.utils.checkpoint`` around each of ``model.blocks``;
- ``torch``: ``torch.compile`` with torch's min-cut partitioner (``torch_compiled``);
- ``remat``: ``remat.optimize`` at the row's budget.

``remat.tools.bench`` measures them; a configuration a method cannot run raises ``Skip``,
which becomes the row's error.
"""

from __future__ import annotations

import torch
from torch import nn

from remat.passes._torch_compat import aot_autograd, boxed, inductor, min_cut_partition
from remat.tools.rows import Row

__all__ = ["Skip", "model_for", "torch_compiled"]


class Skip(Exception):
    """A configuration its method cannot run (the model has no blocks, a budget it does
    not take): a row that says why, not a failure."""


def model_for(row: Row, model: nn.Module, solver) -> nn.Module:
    """What ``row``'s method calls for one training step of ``model`` (``solver``: what
    ``remat.optimize`` gets)."""
    if row.method == "eager":
        return model
    if row.method == "checkpoint":
        return _checkpoint_blocks(model)
    if row.method == "torch":
        if isinstance(row.budget, int) and not 0 <= row.budget <= 1:
            raise Skip("torch's activation_memory_budget is a fraction in [0, 1]")
        return torch_compiled(model, row.compiler)
    return _remat_optimized(model, row, solver)


def _checkpoint_blocks(model: nn.Module) -> nn.Module:
    """``model`` with each of ``model.blocks`` run under ``torch.utils.checkpoint``: the
    sqrt(n) rule by hand."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) or len(blocks) == 0:
        raise Skip("the model has no `blocks` (nn.ModuleList or nn.Sequential)")
    for i in range(len(blocks)):
        blocks[i] = _Checkpointed(blocks[i])
    return model


class _Checkpointed(nn.Module):
    """``torch.utils.checkpoint`` around one block (non-reentrant, any arguments)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def torch_compiled(model: nn.Module, compiler: str) -> nn.Module:
    """``model`` under ``torch.compile``, partitioned by torch's min-cut: the stock
    inductor pipeline, or with ``compiler="eager"`` the programs run as plain fx, as
    remat's eager compiler runs them."""
    if compiler == "inductor":
        # Inductor partitions with min-cut. A backend object of its own per configuration:
        # with the shared "inductor" one dynamo reused the first budget's compiled step for
        # every later budget (same code, guards passing), so all measured alike.
        def backend(gm, example_inputs):
            return inductor(gm, example_inputs)

        return torch.compile(model, backend=backend, dynamic=False)

    def plain(gm, _example_inputs):  # fx run as Python, as remat's eager compiler does
        return boxed(gm)

    backend = aot_autograd(fw_compiler=plain, bw_compiler=plain, partition_fn=min_cut_partition)
    return torch.compile(model, backend=backend, dynamic=False)


def _remat_optimized(model: nn.Module, row: Row, solver) -> nn.Module:
    """``remat.optimize`` at the row's budget: a fraction in (0, 1], else bytes."""
    import remat

    if row.budget == 0:
        raise Skip("remat budgets are fractions in (0, 1] or bytes, not 0")
    # bytes were read already (--budgets) or are pareto's own: a Budget, so a small number
    # of them is not refused as ambiguous
    budget = float(row.budget) if 0 < row.budget <= 1 else remat.Budget(nbytes=int(row.budget))
    return remat.optimize(
        model, budget=budget, solver=solver, compiler=row.compiler, cost_model=row.cost_model
    )
