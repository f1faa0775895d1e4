"""The graphs the cost-model tests read: five small models (an MLP, a transformer block,
conv + batch norm + dropout, a chain of views, SDPA attention) whose AOTAutograd joint
graphs ``_joint`` captures (traced once per process: the ``graphs`` fixture of
``conftest.py``), and ``_fake_graph``, hand-built aten graphs with fake-tensor metadata
for ops AOTAutograd does not emit."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from remat.costs import DeviceSpec

aten = torch.ops.aten
CPU = DeviceSpec.for_device("cpu")


def _joint(model: torch.nn.Module, *inputs: torch.Tensor) -> fx.GraphModule:
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition

    captured = {}

    def partition(joint_gm, joint_inputs, **kw):
        captured["gm"] = joint_gm
        return default_partition(joint_gm, joint_inputs, **kw)

    backend = aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm),
        bw_compiler=lambda gm, _: make_boxed_func(gm),
        partition_fn=partition,
    )
    torch._dynamo.reset()
    out = torch.compile(model, backend=backend)(*inputs)
    out.sum().backward()
    return captured["gm"]


class _Block(torch.nn.Module):
    """Transformer block with explicit attention (bmm, softmax, dropout)."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.ln = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.o = torch.nn.Linear(d, d)
        self.drop = torch.nn.Dropout(0.1)
        self.ff = torch.nn.Sequential(
            torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
        )

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        q = q.view(b, t, self.h, -1).transpose(1, 2)
        k = k.reshape(b, t, self.h, -1).transpose(1, 2)
        v = v.view(b, t, self.h, -1).permute(0, 2, 1, 3)
        a = self.drop(((q @ k.transpose(-2, -1)) / (d // self.h) ** 0.5).softmax(-1))
        x = x + self.o((a @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.ff(x)


class _ConvBN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x):
        return self.drop(torch.relu(self.bn(self.conv(x)))).flatten(1)


class _Views(torch.nn.Module):
    """split/unbind/view/reshape/transpose/expand/slice/select chain."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 48)

    def forward(self, x):
        a, b, c = self.lin(x).split(16, dim=1)
        d, e = a.view(-1, 2, 8).unbind(1)
        y = (a * b + c).t().reshape(-1)
        return (
            y.sum()
            + (d * e).sum()
            + x.expand(2, -1, -1).sum()
            + x[1:, ::2].sum()
            + x.unsqueeze(0).squeeze(0).select(1, 0).sum()
        )


class _SDPA(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.lin(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _calls(gm: fx.GraphModule, target=None) -> list[fx.Node]:
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and (target is None or n.target == target)
    ]


def _all_calls(graphs) -> list[fx.Node]:
    return [n for gm in graphs.values() for n in _calls(gm)]


def _fake_graph(build, *examples: torch.Tensor) -> fx.GraphModule:
    """Hand-built aten graph with FakeTensor metadata, for ops AOT does not emit."""
    g = fx.Graph()
    ins = [g.placeholder(f"x{i}") for i in range(len(examples))]
    g.output(build(g, *ins))
    gm = fx.GraphModule(torch.nn.Module(), g)
    mode = FakeTensorMode()
    FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(e) for e in examples])
    return gm


def _sp(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()
