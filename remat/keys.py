"""What determines a plan, printed and hashed: the names of plan cache entries (``remat.cache``).

A joint graph's problem is determined by the graph (ops, arguments, and each value's shape,
strides and dtype), which inputs the runtime overwrites, the cost model, the device it is
measured on, and the code that reads them (a hash of remat's source, so a changed cost
rule is never answered from an older entry, and torch's version). A plan is
determined by its problem, the budget in bytes and the solver with its options. Anything
else in a key would only cost hits; anything missing would hand a plan to the wrong graph.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
from collections.abc import Callable
from pathlib import Path

import torch
from torch import fx

from remat import passes, solvers
from remat.costs import DeviceSpec
from remat.passes._torch_compat import mutated_inputs
from remat.solvers import Problem
from remat.version import __version__


def digest(*parts: object) -> str:
    """A short stable hash of ``parts`` (JSON-printable)."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def versions() -> tuple[str, str]:
    return source_digest(), torch.__version__


@functools.cache
def source_digest() -> str:
    """A hash of remat's Python source (its three packages): a development checkout
    between releases changes it with every edit of a cost rule or solver."""
    h = hashlib.sha256(__version__.encode())
    for root in (Path(__file__).parent, *(Path(p.__file__).parent for p in (passes, solvers))):
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def device_name(device: torch.device) -> str:
    """The device as the cost model sees it (GPU model, CPU thread count) and the machine."""
    return f"{DeviceSpec.for_device(device).name} on {platform.machine()} {platform.processor()}"


def graph_text(joint: fx.GraphModule, num_fwd_outputs: int) -> str:
    """``joint`` printed canonically: one line per node with its op, target, arguments
    (nodes by name) and value metadata, then the forward output count and the inputs the
    runtime overwrites. Equal texts give equal problems under one cost model and device."""
    lines = [f"fwd outputs {num_fwd_outputs}"]
    for node in joint.graph.nodes:
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{n.name}")
        tag = node.meta.get("partitioner_tag", "")
        lines.append(
            f"{node.name} {node.op} {_target(node.target)} {args!r} {tag} "
            f"{_value(node.meta.get('val'))}"
        )
    lines.append("mutated " + " ".join(sorted(n.name for n in mutated_inputs(joint))))
    return "\n".join(lines)


def _target(target: object) -> str:
    """An op's name (``aten.mm.default``), a function's ``module.name``: never an address."""
    text = str(target)
    if " at 0x" not in text:
        return text
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', text)}"


def _value(val: object) -> str:
    if isinstance(val, torch.Tensor):
        return (
            f"{val.dtype}{list(val.shape)}/{list(val.stride())}+{val.storage_offset()}"
            f"@{val.device.type} grad={val.requires_grad}"
        )
    if isinstance(val, (list, tuple)):
        return "(" + ",".join(_value(v) for v in val) + ")"
    return type(val).__name__ if val is not None else "-"


def problem_key(joint: fx.GraphModule, num_fwd_outputs: int, cost_model: str, device) -> str:
    return digest(
        "problem", graph_text(joint, num_fwd_outputs), cost_model, device_name(device), versions()
    )


def candidates_key(joint: fx.GraphModule, num_fwd_outputs: int) -> str:
    """The key of the saved sets other partitioners give ``joint`` (torch's): the graph
    and the code alone, no cost model or device (torch's partition reads neither)."""
    return digest("candidates", graph_text(joint, num_fwd_outputs), versions())


def plan_key(problem: Problem, limit: int, solver: str) -> str:
    """The key of ``problem``'s plan under ``limit`` bytes by ``solver`` (``solver_key``).
    The problem's name is left out: it names the graph in messages only."""
    nodes = [
        (n.name, n.phase, n.bytes, n.cost, n.inputs, n.recomputable, n.alias_of, n.output_of,
         n.op, n.workspace, n.save_cost)
        for n in problem.nodes
    ]  # fmt: skip
    content = (nodes, problem.outputs, problem.grads, problem.resident_bytes)
    return digest("plan", content, limit, solver, versions())


def solver_key(solver: str | Callable) -> str | None:
    """A name for ``solver`` and its options that is the same in every process: the name
    given, ``module.function`` with a partial's arguments; None where there is no such name
    (a lambda, a local function, an object): its plans are not cached."""
    if isinstance(solver, str):
        return solver
    if isinstance(solver, functools.partial):
        inner = solver_key(solver.func)
        if inner is None:
            return None
        options = [repr(a) for a in solver.args]
        options += [f"{k}={v!r}" for k, v in sorted(solver.keywords.items())]
        text = f"{inner}({', '.join(options)})"
        return None if " at 0x" in text else text
    module = getattr(solver, "__module__", None)
    name = getattr(solver, "__qualname__", None)
    if not module or not name or "<" in name:
        return None
    return f"{module}.{name}"
