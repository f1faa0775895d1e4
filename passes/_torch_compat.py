"""Every private PyTorch API remat touches, in one file, so a torch upgrade edits one place."""

from __future__ import annotations

import torch
from torch import fx
from torch._functorch.partitioners import _extract_fwd_bwd_modules
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["boxed", "extract_fwd_bwd_modules", "mutated_inputs", "real_tensors", "storage_of"]


def extract_fwd_bwd_modules(
    joint: fx.GraphModule,
    saved_values: list[fx.Node],
    saved_sym_nodes: list[fx.Node],
    num_fwd_outputs: int,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Split ``joint`` into forward and backward modules that exchange ``saved_*``.

    torch's helper builds the signatures AOTAutograd's runtime expects (saved
    tensors vs symbolic sizes, tangents, RNG seeds); remat then fixes the order.
    """
    return _extract_fwd_bwd_modules(
        joint, saved_values, saved_sym_nodes, num_fwd_outputs=num_fwd_outputs
    )


def boxed(gm: fx.GraphModule):
    """Compile ``gm`` to plain Python that takes one list and clears it, so each input
    can be freed right after its last use (as torch's aot_eager does)."""
    from torch._dynamo.backends.debugging import boxed_nop

    return boxed_nop(gm, [])


def mutated_inputs(joint: fx.GraphModule) -> set[fx.Node]:
    """Placeholders the AOT runtime overwrites after the forward (BatchNorm running stats).

    Read from the output node's AOT descriptors: an ``InputMutationAOTOutput``
    names the input whose new value it carries.
    """
    descs = joint.graph.output_node().meta.get("desc") or []
    mutated = [d.mutated_input for d in descs if type(d).__name__ == "InputMutationAOTOutput"]
    return {n for n in joint.graph.find_nodes(op="placeholder") if n.meta.get("desc") in mutated}


def real_tensors():
    """Context in which tensors are real even inside a compile (where a FakeTensorMode
    is active): needed to measure ops on the device while planning."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def storage_of(value) -> StorageWeakRef | None:
    """A hashable handle on the storage a tensor (real or fake) lives in, equal for every
    view of it; None for non-tensors and tensors without one storage (sparse, nested)."""
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return StorageWeakRef(value.untyped_storage())
    except Exception:  # sparse and nested tensors have no single storage
        return None
