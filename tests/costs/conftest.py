"""The cost model (``remat.costs``), grounded in real AOTAutograd joint graphs and real
tensors. A test goes in the file of the module it checks: ``test_costs_graph.py`` (bytes,
aliasing, flops), ``test_costs_flags.py`` (random ops, side effects),
``test_costs_device.py`` (device specs, the roofline), ``test_costs_measured.py`` (kernel
time and memory measured on the device), ``test_cost_model.py`` (``CostModel``, the
registry); what a plan's step time is made of (fused ops under inductor, save costs,
torch's partition as a candidate) is ``test_step_time.py``.

``graphs`` is session-scoped: its five joint graphs are traced once per process (each
xdist worker), not once per file, and no test changes them. The models and the helpers
the files share are in ``sample_graphs.py``, importable whatever pytest's import mode."""

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.fx as fx

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from sample_graphs import _SDPA, _Block, _ConvBN, _joint, _Views  # noqa: E402


@pytest.fixture(scope="session")
def graphs() -> dict[str, fx.GraphModule]:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(64, 64),
        torch.nn.GELU(),
        torch.nn.LayerNorm(64),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(64, 8),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "mlp": _joint(mlp, torch.randn(32, 64)),
            "block": _joint(_Block(), torch.randn(2, 8, 32)),
            "conv": _joint(_ConvBN(), torch.randn(2, 3, 8, 8)),
            "views": _joint(_Views(), torch.randn(4, 16, requires_grad=True)),
            "sdpa": _joint(_SDPA(), torch.randn(2, 8, 16)),
        }
