"""Synthetic joint graphs shaped like real training steps, for tests and benchmarks."""

from __future__ import annotations

import random

from .problem import Node, Problem


def chain(
    layers: int,
    *,
    act_bytes: int = 1 << 20,
    matmul_cost: float = 1.0,
    pointwise_cost: float = 0.1,
    grad_bytes: int = 1 << 16,
) -> Problem:
    """An MLP: per layer ``a = x @ W`` then ``h = relu(a)``, and its mirrored backward.

    The backward of layer k reads ``h_k`` (the relu mask) and ``h_{k-1}`` (for
    the weight gradient), as autograd's does.
    """
    nodes: list[Node] = []

    def add(name, phase, nbytes, cost, inputs=()):
        nodes.append(Node(name, phase, nbytes, cost, tuple(inputs)))
        return len(nodes) - 1

    tangent = add("tangent", "bwd", 4, 0.0)
    h = [add("x", "fwd", act_bytes, pointwise_cost)]
    for k in range(1, layers + 1):
        a = add(f"mm{k}", "fwd", act_bytes, matmul_cost, [h[-1]])
        h.append(add(f"relu{k}", "fwd", act_bytes, pointwise_cost, [a]))
    loss = add("loss", "fwd", 4, pointwise_cost, [h[-1]])
    g = add("loss_bw", "bwd", act_bytes, pointwise_cost, [tangent, h[-1]])
    grads = []
    for k in range(layers, 0, -1):
        ga = add(f"relu{k}_bw", "bwd", act_bytes, pointwise_cost, [g, h[k]])
        grads.append(add(f"dW{k}", "bwd", grad_bytes, matmul_cost, [ga, h[k - 1]]))
        g = add(f"mm{k}_bw", "bwd", act_bytes, matmul_cost, [ga])
    return Problem(tuple(nodes), outputs=(loss,), grads=tuple(grads), name=f"chain{layers}")


def random_joint(
    n_forward: int,
    seed: int,
    *,
    max_inputs: int = 3,
    p_view: float = 0.1,
    p_random: float = 0.05,
    p_multi: float = 0.05,
) -> Problem:
    """A random DAG forward with views, random ops and multi-output ops, plus a backward
    that, like autograd's, visits forward nodes in reverse and reads some of them."""
    rng = random.Random(seed)
    nodes: list[Node] = [Node("tangent", "bwd", rng.randint(1, 64), 0.0)]
    fwd: list[int] = []

    def add(node: Node) -> int:
        nodes.append(node)
        return len(nodes) - 1

    while len(fwd) < n_forward:
        k = len(fwd)
        inputs = tuple(sorted(set(rng.sample(fwd, min(len(fwd), rng.randint(1, max_inputs))))))
        roll = rng.random()
        if fwd and roll < p_view:
            fwd.append(add(Node(f"view{k}", "fwd", 0, 0.0, inputs[:1], alias_of=inputs[0])))
        elif roll < p_view + p_multi:
            random_op = rng.random() < 0.5
            op = add(
                Node(f"multi{k}", "fwd", 0, rng.uniform(0.1, 5), inputs, recomputable=not random_op)
            )
            for part in range(2):
                fwd.append(
                    add(
                        Node(
                            f"multi{k}.{part}",
                            "fwd",
                            rng.randint(1, 1000),
                            0.0,
                            (op,),
                            recomputable=not random_op,
                            output_of=op,
                        )
                    )
                )
        else:
            fwd.append(
                add(
                    Node(
                        f"op{k}",
                        "fwd",
                        rng.randint(1, 1000),
                        rng.uniform(0.1, 5),
                        inputs,
                        recomputable=rng.random() >= p_random,
                    )
                )
            )
    out = add(Node("loss", "fwd", 4, 0.1, (fwd[-1],)))
    grads, grad = [], 0
    for i in reversed(fwd):
        reads = (i,) if rng.random() < 0.6 else ()
        grad = add(
            Node(
                f"{nodes[i].name}_bw",
                "bwd",
                rng.randint(1, 1000),
                rng.uniform(0.1, 5),
                (grad, *reads),
            )
        )
        if rng.random() < 0.3:
            grads.append(grad)
    grads.append(grad)
    return Problem(tuple(nodes), outputs=(out,), grads=tuple(grads), name=f"random{seed}")
