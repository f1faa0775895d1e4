"""Synthetic joint graphs shaped like real training steps, for tests and benchmarks.

A test utility, not part of the library: the tests import it as ``synthetic``
(``conftest.py`` puts this folder on ``sys.path``), the benchmark scripts through
``benchmarks/_test_graphs.py``. It needs only ``remat.solvers`` (no torch), so
``test_no_torch.py`` builds its problem with it on a standalone copy of the solvers.
"""

from __future__ import annotations

import random

from remat.solvers import Node, Problem


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


_PEAK_FLOPS = 1e13  # the roofline of ``layered``'s costs: FLOP/s and bytes/s of a GPU
_BANDWIDTH = 1e12


def layered(
    layers: int,
    *,
    seed: int = 0,
    width: int = 256,
    seq: int = 256,
    batch: int = 4,
    heads: int = 4,
    dtype_bytes: int = 4,
) -> Problem:
    """A pre-LayerNorm GPT decoder stack's joint graph, shaped like AOTAutograd's.

    Forward, per layer (22 nodes): ``native_layer_norm`` as a multi-output op
    (normalised output, plus its mean/rstd statistics as one small part), the qkv
    matmul (3x hidden bytes), q/k/v views of it (``alias_of``, 0 bytes), the
    attention scores ``q @ k.T`` (``batch * heads * seq**2`` elements, scale and
    mask folded in), softmax, dropout as a non-recomputable multi-output op (output
    and bool mask), ``attn @ v``, the output projection, the residual add, a second
    layer norm, the MLP up matmul (4x hidden bytes), GELU, the down matmul and the
    second residual add. An embedding starts the stack; the loss reads the last
    residual directly (no head).

    Backward (22 nodes per layer) walks the layers in reverse from a single
    tangent, as autograd does: a node per input gradient of each op, reading what
    autograd saves (matmul inputs, the softmax output, the dropout output and mask,
    the GELU input, the layer-norm input and statistics), the residual-gradient
    adds, and a weight-gradient node per matmul and layer norm (returned in
    ``grads``, so held to the end of the step).

    ``44 * layers + 5`` nodes. Bytes follow the shapes (``dtype_bytes`` per
    element); costs are roofline seconds, ``max(flops / 1e13, bytes moved / 1e12)``:
    matmuls cost their flops, pointwise ops the bytes they read and write. ``seed``
    only jitters each cost by up to ±10% (as measured costs would), so layers are
    not exact copies; the structure and the bytes depend only on the sizes.
    """
    rng = random.Random(seed)
    tokens = batch * seq
    hidden = tokens * width * dtype_bytes
    scores = batch * heads * seq * seq * dtype_bytes
    stats = 2 * tokens * dtype_bytes  # mean and rstd, one float per token each
    bmm_flops = 2.0 * tokens * seq * width  # q @ k.T and attn @ v over all heads
    nodes: list[Node] = []
    grads: list[int] = []

    def add(name, phase, nbytes, inputs=(), flops=0.0, moved=0, **kw) -> int:
        cost = max(flops / _PEAK_FLOPS, moved / _BANDWIDTH)
        cost *= rng.uniform(0.9, 1.1) if cost else 1.0
        nodes.append(Node(name, phase, nbytes, cost, tuple(inputs), **kw))
        return len(nodes) - 1

    def matmul(name, phase, m, k, n, inputs) -> int:  # [m, k] @ [k, n]
        out = m * n * dtype_bytes
        return add(name, phase, out, inputs, 2.0 * m * k * n, out, op="mm")

    def pointwise(name, phase, nbytes, inputs, **kw) -> int:
        moved = nbytes + sum(nodes[i].bytes for i in inputs)
        return add(name, phase, nbytes, inputs, 0.0, moved, **kw)

    def layer_norm(name, x) -> tuple[int, int]:
        op = add(name, "fwd", 0, [x], 0.0, 3 * hidden, op="native_layer_norm")
        out = add(f"{name}.out", "fwd", hidden, [op], output_of=op)
        return out, add(f"{name}.stats", "fwd", stats, [op], output_of=op)

    def layer_norm_bw(name, grad, x, mean_rstd) -> int:
        dx = pointwise(name, "bwd", hidden, [grad, x, mean_rstd])
        grads.append(pointwise(f"{name}.dw", "bwd", 2 * width * dtype_bytes, [grad, x, mean_rstd]))
        return dx

    def matmul_bw(name, m, k, n, grad, x) -> int:
        """``y = x[m, k] @ W[k, n]``: dx reads the gradient, dW reads x too."""
        dx = matmul(name, "bwd", m, n, k, [grad])
        grads.append(matmul(f"{name}.dW", "bwd", k, m, n, [x, grad]))
        return dx

    tangent = add("tangent", "bwd", dtype_bytes)
    x = pointwise("embed", "fwd", hidden, [], op="embedding")
    fwd = []  # per layer, its forward values by name
    for layer in range(layers):
        p, f = f"L{layer}.", {"x": x}
        f["ln1"], f["ln1_stats"] = layer_norm(p + "ln1", x)
        qkv = matmul(p + "qkv", "fwd", tokens, width, 3 * width, [f["ln1"]])
        for s in "qkv":
            f[s] = add(p + s, "fwd", 0, [qkv], alias_of=qkv, op="view")
        sc = add(p + "scores", "fwd", scores, [f["q"], f["k"]], bmm_flops, scores, op="bmm")
        f["soft"] = pointwise(p + "softmax", "fwd", scores, [sc], op="softmax")
        mask, moved = scores // dtype_bytes, 2 * scores + scores // dtype_bytes  # bool mask
        drop = add(p + "dropout", "fwd", 0, [f["soft"]], 0.0, moved, recomputable=False)
        for part, nbytes in (("drop", scores), ("mask", mask)):
            name = f"{p}dropout.{part}"
            f[part] = add(name, "fwd", nbytes, [drop], output_of=drop, recomputable=False)
        attn_in = [f["drop"], f["v"]]
        f["attn"] = add(p + "attn", "fwd", hidden, attn_in, bmm_flops, hidden, op="bmm")
        proj = matmul(p + "proj", "fwd", tokens, width, width, [f["attn"]])
        f["res1"] = pointwise(p + "resid1", "fwd", hidden, [x, proj], op="add")
        f["ln2"], f["ln2_stats"] = layer_norm(p + "ln2", f["res1"])
        f["up"] = matmul(p + "up", "fwd", tokens, width, 4 * width, [f["ln2"]])
        f["gelu"] = pointwise(p + "gelu", "fwd", 4 * hidden, [f["up"]], op="gelu")
        down = matmul(p + "down", "fwd", tokens, 4 * width, width, [f["gelu"]])
        x = pointwise(p + "resid2", "fwd", hidden, [f["res1"], down], op="add")
        fwd.append(f)
    loss = pointwise("loss", "fwd", dtype_bytes, [x], op="loss")

    g = pointwise("loss_bw", "bwd", hidden, [tangent, x])
    for layer in reversed(range(layers)):
        p, f = f"L{layer}.", fwd[layer]
        d = matmul_bw(p + "down_bw", tokens, 4 * width, width, g, f["gelu"])
        d = pointwise(p + "gelu_bw", "bwd", 4 * hidden, [d, f["up"]])
        d = matmul_bw(p + "up_bw", tokens, width, 4 * width, d, f["ln2"])
        d = layer_norm_bw(p + "ln2_bw", d, f["res1"], f["ln2_stats"])
        g = pointwise(p + "resid1_bw", "bwd", hidden, [g, d])
        d_attn = matmul_bw(p + "proj_bw", tokens, width, width, g, f["attn"])
        d = add(p + "attn_bw.a", "bwd", scores, [d_attn, f["v"]], bmm_flops, scores)
        d_v = add(p + "attn_bw.v", "bwd", hidden, [f["drop"], d_attn], bmm_flops, hidden)
        d = pointwise(p + "dropout_bw", "bwd", scores, [d, f["mask"]])
        d = pointwise(p + "softmax_bw", "bwd", scores, [d, f["soft"]])
        d_q = add(p + "scores_bw.q", "bwd", hidden, [d, f["k"]], bmm_flops, hidden)
        d_k = add(p + "scores_bw.k", "bwd", hidden, [d, f["q"]], bmm_flops, hidden)
        d = pointwise(p + "qkv_cat", "bwd", 3 * hidden, [d_q, d_k, d_v])
        d = matmul_bw(p + "qkv_bw", tokens, width, 3 * width, d, f["ln1"])
        d = layer_norm_bw(p + "ln1_bw", d, f["x"], f["ln1_stats"])
        g = pointwise(p + "resid0_bw", "bwd", hidden, [g, d])
    grads.append(pointwise("embed_bw", "bwd", hidden, [g]))
    return Problem(tuple(nodes), outputs=(loss,), grads=tuple(grads), name=f"layered{layers}")
