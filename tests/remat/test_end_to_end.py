"""remat.optimize on the built-in examples: eager's numbers, under the budget, as predicted."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

import remat
from remat import examples, memory
from remat.planner import step_peak
from remat.solvers import min_peak_plan

# Small sizes: each optimize() traces once (a few seconds on 2 cores).
SIZES = {
    "mlp": dict(layers=8, width=128, batch=512),
    "cnn": dict(),
    "gpt": dict(layers=2, d_model=64, heads=4, seq=64, batch=4, vocab=256, dropout=0.0),
    "unet": dict(),
}
STEPS = 3


def build(name: str, **overrides):
    return examples.load(name, **{**SIZES[name], **overrides})


def train(model: torch.nn.Module, step_model, inputs, steps: int = STEPS):
    """SGD steps; returns per-step losses and the gradients of the last step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = step_model(*inputs)
        loss.backward()
        losses.append(loss.detach())
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
    return torch.stack(losses), grads


def min_budget(name: str) -> int:
    model, inputs = build(name)
    report = remat.plan(model, inputs, budget=1.0)
    return min_peak_plan(report.graphs[0].extracted.problem).peak


# The CNN's forward alone (first-stage activations plus convolution scratch) peaks
# above half its store-all peak, so no plan of remat's reaches 0.5 there (the
# greedy's minimum is ~57%, batch norm's backward scratch included); it is tested at
# 0.6 instead.
CASES = [(name, b) for name in sorted(SIZES) for b in (1.0, 0.7, 0.5, "min") if name != "cnn"]
CASES += [("cnn", b) for b in (1.0, 0.7, 0.6, "min")]


@pytest.mark.slow
@pytest.mark.parametrize("name,budget", CASES)
def test_training_matches_eager(name, budget):
    if budget == "min":
        budget = min_budget(name)
    model, inputs = build(name)
    reference = copy.deepcopy(model)
    optimized = remat.optimize(model, budget=budget)

    losses, grads = train(model, optimized, inputs)
    ref_losses, ref_grads = train(reference, reference, inputs)

    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for key in grads:
        torch.testing.assert_close(grads[key], ref_grads[key], rtol=1e-4, atol=1e-5)
    for (key, p), (_, q) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=key)
    for (key, b), (_, c) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=1e-4, atol=1e-5, msg=key)
    report = optimized.remat.report()
    assert report.graphs and all(g.plan.peak <= g.budget for g in report.graphs)


@pytest.mark.slow
def test_batchnorm_statistics_update_once_per_step():
    model, inputs = build("cnn")
    reference = copy.deepcopy(model)
    optimized = remat.optimize(model, budget=0.6)
    train(model, optimized, inputs)
    train(reference, reference, inputs)
    counts = [b for k, b in model.named_buffers() if k.endswith("num_batches_tracked")]
    assert counts and all(int(c) == STEPS for c in counts)
    means = [k for k, _ in model.named_buffers() if k.endswith("running_mean")]
    for key in means:
        torch.testing.assert_close(model.get_buffer(key), reference.get_buffer(key))


@pytest.mark.slow
def test_recomputed_dropout_replays_eagers_mask():
    """At a tight budget dropout is recomputed; its replay draws the forward's mask, so
    gradients equal eager's and the step leaves the RNG where eager leaves it."""

    def step(optimize):
        torch.manual_seed(0)
        model, inputs = build("gpt", dropout=0.2)
        run = remat.optimize(model, budget=0.5) if optimize else model
        torch.manual_seed(1)
        loss = run(*inputs)
        loss.backward()
        grads = {k: p.grad for k, p in model.named_parameters()}
        return loss.detach(), grads, torch.get_rng_state(), run

    ref_loss, ref_grads, ref_rng, _ = step(optimize=False)
    loss, grads, rng, optimized = step(optimize=True)
    graph = optimized.remat.report().graphs[0]
    nodes = graph.extracted.problem.nodes
    replays = {i for i, n in enumerate(nodes) if "dropout_mask" in n.op}
    assert replays and all(nodes[i].recomputable for i in replays)
    assert replays & graph.plan.recomputed, "a 50% budget should recompute dropout"
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for key in ref_grads:
        torch.testing.assert_close(grads[key], ref_grads[key], rtol=1e-4, atol=1e-5)
    assert torch.equal(rng, ref_rng)


@pytest.mark.slow
def test_recomputed_dropout_under_bfloat16_autocast_keeps_eagers_bits():
    """Under autocast dropout runs in bfloat16, where ``native_dropout`` rounds its scale
    to the dtype: the forward's loss is eager's to the bit, and the gradients those of the
    same joint graph compiled without planning (``aot_eager``), recomputed dropout and all
    (eager's own backward differs from any compiled one in bfloat16 by about 1%)."""

    def step(compile_with):
        torch.manual_seed(0)
        model, inputs = build("gpt", dropout=0.1)  # 1/0.9 is not a bfloat16
        run = compile_with(model)
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = run(*inputs)
        loss.backward()
        return loss.detach(), {k: p.grad for k, p in model.named_parameters()}, run

    eager_loss, _, _ = step(lambda m: m)
    aot_loss, aot_grads, _ = step(lambda m: torch.compile(m, backend="aot_eager"))
    loss, grads, optimized = step(lambda m: remat.optimize(m, budget=0.5))
    graph = optimized.remat.report().graphs[0]
    nodes = graph.extracted.problem.nodes
    replays = {i for i, n in enumerate(nodes) if "dropout_mask" in n.op}
    assert replays & graph.plan.recomputed, "a 50% budget should recompute dropout"
    assert torch.equal(loss, eager_loss) and torch.equal(aot_loss, eager_loss)
    for key, grad in aot_grads.items():
        assert torch.equal(grads[key], grad), key


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "unet"])
def test_measured_peak_keeps_the_budget_and_matches_prediction(name):
    measured = []
    for fraction in (1.0, 0.7, 0.5):
        model, inputs = build(name)
        optimized = remat.optimize(model, budget=fraction)
        optimized(*inputs).backward()  # compile and warm up
        model.zero_grad(set_to_none=True)
        peak = memory.peak(lambda m=optimized, x=inputs: m(*x).backward()).peak_bytes
        report = optimized.remat.report()
        budget = report.graphs[0].budget
        predicted = report.predicted_peak
        assert peak <= budget, (fraction, peak, budget)
        # the rewritten programs run the simulated schedule; CPU allocations are exact
        assert predicted == peak, (fraction, predicted, peak)
        measured.append(peak)
    assert measured == sorted(measured, reverse=True), measured


class _Attention(torch.nn.Module):
    """One causal attention layer through ``F.scaled_dot_product_attention``."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.qkv, self.out, self.heads = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d), heads

    def forward(self, x):
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(a.transpose(1, 2).reshape(b, t, d)).square().mean()


class _Regression(torch.nn.Module):
    """A linear layer under ``mse_loss``, whose CPU kernel returns the loss in an
    input-sized buffer that lives until the step ends."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        return torch.nn.functional.mse_loss(self.lin(x), x)


class _LossAndActivations(torch.nn.Module):
    """Returns the loss and an activation, like a model returning its logits beside the
    loss: autograd feeds the backward zeros for the activation, freed after their use."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        h = self.lin(x).relu()
        return h.square().mean(), h * 2


@pytest.mark.parametrize("make", [_Attention, _Regression, _LossAndActivations])
def test_peak_is_predicted_to_the_byte(make):
    """Where kernels allocate more than their outputs (the attention backward's scratch,
    mse_loss's buffer) and where autograd hands the backward a tangent it does not hold,
    the prediction stays exact on CPU."""
    torch.manual_seed(0)
    model, x = make(), torch.randn(2, 64, 32)
    optimized = remat.optimize(model, budget=1.0)

    def step():
        out = optimized(x)
        (out[0] if isinstance(out, tuple) else out).backward()

    step()  # compile and warm up
    model.zero_grad(set_to_none=True)
    assert memory.peak(step).peak_bytes == optimized.remat.report().predicted_peak


def test_recompile_limit_is_an_error_not_an_eager_step():
    """Past dynamo's recompile limit a step would run eagerly, outside the budget."""
    models = [build("mlp", layers=2, width=16, batch=8) for _ in range(2)]
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        first = remat.optimize(models[0][0], budget=1.0)
        first(*models[0][1]).backward()
        second = remat.optimize(models[1][0], budget=1.0)
        with pytest.raises(remat.RecompileLimitHit, match="recompile_limit"):
            second(*models[1][1])
    assert len(second.remat.graphs) == 0
    torch._dynamo.reset()


class _GRUClassifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.GRU(8, 16, batch_first=True)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x, y):
        h, _ = self.rnn(x)
        return torch.nn.functional.cross_entropy(self.head(h[:, -1]), y)


def test_a_forward_dynamo_skips_is_an_error_not_an_eager_step():
    """dynamo skips a whole forward that holds an nn.GRU (unless allow_rnn): the step would
    run eagerly, outside the budget, and the report said "call the model once"."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 6, 8), torch.randint(0, 4, (4,))
    optimized = remat.optimize(_GRUClassifier(), budget=0.9)
    with pytest.raises(remat.NothingCompiled, match="allow_rnn"):
        optimized(x, y)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(allow_rnn=True):
        model = _GRUClassifier()
        reference = copy.deepcopy(model)
        optimized = remat.optimize(model, budget=0.9)
        optimized(x, y).backward()
        reference(x, y).backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
        model.zero_grad(set_to_none=True)
        measured = memory.peak(lambda: optimized(x, y).backward()).peak_bytes
        assert measured == optimized.remat.report().predicted_peak
    torch._dynamo.reset()


def test_budget_below_minimum_names_it():
    model, inputs = build("mlp")
    optimized = remat.optimize(model, budget=1024)
    with pytest.raises(remat.InfeasibleBudget) as info:
        optimized(*inputs)
    assert info.value.minimum > 1024
    assert str(info.value.minimum) in str(info.value)


def test_optimized_module_shares_parameters_and_keys():
    model, inputs = build("mlp")
    optimized = remat.optimize(model, budget=0.8)
    assert list(optimized.state_dict()) == list(model.state_dict())
    assert all(p is q for p, q in zip(optimized.parameters(), model.parameters(), strict=True))
    assert isinstance(optimized, type(model)) and not hasattr(model, "remat")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = next(model.parameters()).detach().clone()
    optimized(*inputs).backward()
    opt.step()
    assert not torch.equal(before, next(optimized.parameters()))


class _TrainingOnlyBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.linear(x)
        if self.training:  # the module's own flag, not a submodule's
            y = y + 100.0
        return y.square().mean()


def test_train_and_eval_switch_the_model_and_the_optimized_module_alike():
    """A copy kept its own ``training`` flag: after ``model.eval()`` the optimized module
    still ran the training branch (10016.0 against eager's 0.27)."""
    torch._dynamo.reset()
    model, x = _TrainingOnlyBranch(), torch.randn(4, 8)
    optimized = remat.optimize(model, budget=1.0)
    optimized(x).backward()
    model.eval()
    with torch.no_grad():
        assert optimized(x).item() == model(x).item()
    optimized.train()
    assert model.training
    with pytest.raises(TypeError, match="deep-copy the original module"):
        copy.deepcopy(optimized)


class _TensorLiteral(torch.nn.Module):
    """A tensor literal in ``forward``: the graph holds it as a constant (``get_attr``), as
    a Hugging Face T5 does; remat's reorder took it for a node the schedule lacked."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x):
        h = self.a(x).relu() * torch.tensor([1.5] * 64)
        return self.b(h.tanh()).square().mean()


@pytest.mark.parametrize("budget", [1.0, "min"])
def test_tensor_constants_in_the_graph_are_inputs_of_both_programs(budget):
    torch.manual_seed(0)
    model, x = _TensorLiteral(), torch.randn(256, 64)
    if budget == "min":
        budget = min_peak_plan(remat.plan(model, (x,), 1.0).graphs[0].extracted.problem).peak
    reference = copy.deepcopy(model)
    reference(x).backward()
    optimized = remat.optimize(model, budget=budget)
    optimized(x).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    model.zero_grad(set_to_none=True)
    measured = memory.peak(lambda: optimized(x).backward()).peak_bytes
    assert measured == step_peak(list(optimized.remat.graphs), lambda g: g.plan)


def test_plan_takes_keyword_inputs_as_hugging_face_models_want_them():
    model, (x, y) = build("mlp")
    by_position = remat.plan(model, (x, y), budget=0.7, solver="greedy").graphs[0].plan
    by_keyword = remat.plan(model, (x,), budget=0.7, solver="greedy", example_kwargs={"y": y})
    assert by_keyword.graphs[0].plan.saved == by_position.saved


def test_plan_does_not_train_or_touch_buffers():
    model, inputs = build("cnn")
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    report = remat.plan(model, inputs, budget=0.7)
    for k, b in model.named_buffers():
        assert torch.equal(b, buffers[k]), k
    assert all(p.grad is None for p in model.parameters())
    assert report.predicted_peak <= report.graphs[0].budget
    text = str(report)
    assert "predicted peak" in text and "graph0" in text


class _Broken(torch.nn.Module):
    """Two layers with a graph break between them: two graphs, two plans."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
        self.b = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())

    def forward(self, x):
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.b(x).square().mean()


def test_graph_breaks_get_one_plan_each_and_share_an_absolute_budget():
    torch.manual_seed(0)
    model, x = _Broken(), torch.randn(256, 64)
    reference = copy.deepcopy(model)
    budget = 4 * 2**20
    optimized = remat.optimize(model, budget=budget)
    optimized(x).backward()
    reference(x).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    report = optimized.remat.report()
    graphs = report.graphs
    assert len(graphs) == 2
    # graph0's saved values and its output (graph1's input, held by the caller) stay
    # allocated while graph1 runs
    assert graphs[0].held_bytes > graphs[0].saved_bytes
    assert graphs[1].budget == budget - graphs[0].held_bytes
    model.zero_grad(set_to_none=True)
    peak = memory.peak(lambda: optimized(x).backward()).peak_bytes
    assert peak == report.predicted_peak <= budget


def test_a_later_graph_refused_under_an_absolute_budget_counts_what_earlier_ones_hold():
    """graph0 fits 300,000 bytes but then holds 128 KiB (its output, graph1's input), and
    graph1 needs more than the rest: the refusal is in the step's bytes and says why."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _Broken(), torch.randn(256, 64)
    optimized = remat.optimize(model, budget=300_000)
    with pytest.raises(remat.InfeasibleBudget) as refusal:
        optimized(x)
    (graph0,) = optimized.remat.graphs
    e = refusal.value
    assert e.held == graph0.held_bytes > 0
    assert e.budget == 300_000 < e.minimum
    assert "graph graph1" in str(e) and "earlier graphs of the step" in str(e)


class _LossAfterBreak(torch.nn.Module):
    """A graph break before the loss (as HF GPT-2 called with labels has): the loss graph
    cannot shrink below its own store-all peak."""

    def __init__(self):
        super().__init__()
        layers = [torch.nn.Linear(64, 256)] + [torch.nn.Linear(256, 256) for _ in range(5)]
        self.body = torch.nn.Sequential(*(m for layer in layers for m in (layer, torch.nn.GELU())))

    def forward(self, x, target):
        logits = self.body(x)
        torch._dynamo.graph_break()
        return torch.nn.functional.cross_entropy(logits, target)


def test_a_fraction_a_loss_graph_cannot_reach_says_it_applies_per_graph():
    torch._dynamo.reset()
    model, x, t = _LossAfterBreak(), torch.randn(2048, 64), torch.randint(0, 256, (2048,))
    optimized = remat.optimize(model, budget=0.6)
    with pytest.raises(remat.InfeasibleBudget) as refusal:
        optimized(x, t)
    message = str(refusal.value)
    assert "graph graph1" in message and "applies to each graph's own store-all" in message
    torch._dynamo.reset()


class _SharedAcrossBreak(torch.nn.Module):
    """Parameters on both sides of a graph break, ``b`` on both: graph1's backward runs
    first and leaves its gradients in ``.grad`` while graph0's backward runs."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(i, 256) for i in (64, 256, 256))

    def forward(self, x):
        h = self.b(self.a(x).relu()).relu()
        torch._dynamo.graph_break()
        return self.c(self.b(h).relu()).relu().sum()


def test_gradients_of_a_later_graph_count_while_earlier_backwards_run():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _SharedAcrossBreak(), torch.randn(64, 64)
    optimized = remat.optimize(model, budget=1.0)
    optimized(x).backward()
    model.zero_grad(set_to_none=True)
    measured = memory.peak(lambda: optimized(x).backward()).peak_bytes
    report = optimized.remat.report()
    # Graph by graph (each plus what earlier ones hold) predicted 788,488 B against
    # 1,118,216 measured: graph1's gradients (514 KiB) are held during graph0's backward,
    # and b's two gradients are summed into a new tensor after it.
    assert measured > max(report.held_before(g) + g.plan.peak for g in report.graphs)
    # h (graph0's output, graph1's input) is counted until graph0's backward ends; it is
    # freed after its last use there: the one over-prediction, on the safe side.
    passed = x.shape[0] * 256 * 4
    assert measured <= report.predicted_peak <= measured + passed


def test_later_gradients_that_overflow_an_absolute_budget_are_refused():
    """graph0 fits 800,000 bytes on its own; graph1's gradients then take its backward
    to 1.1 MiB: refused when graph1 is planned, naming the step's peak."""
    torch._dynamo.reset()
    model, x = _SharedAcrossBreak(), torch.randn(64, 64)
    optimized = remat.optimize(model, budget=800_000)
    with pytest.raises(ValueError, match="cannot hold this step") as refusal:
        optimized(x)
    assert "graph1 leaves" in str(refusal.value) and "graph break" in str(refusal.value)


def test_a_recompile_for_new_shapes_is_a_step_of_its_own():
    """Recompiled graphs replace the earlier ones for their shapes; they are not later
    graphs of the same step (whose held bytes would shrink their budget)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, budget = _Broken(), 4 * 2**20
    optimized = remat.optimize(model, budget=budget)
    for batch in (256, 128):
        x = torch.randn(batch, 64)
        optimized(x).backward()
        model.zero_grad(set_to_none=True)
        measured = memory.peak(lambda x=x: optimized(x).backward()).peak_bytes
        model.zero_grad(set_to_none=True)
    graphs = optimized.remat.graphs
    assert [str(g.compile_id) for g in graphs] == ["0/0", "1/0", "0/1", "1/1"]
    g0, g1, g2, g3 = graphs
    assert (g2.after, g3.after) == ((), ("graph2",))
    assert g2.budget == budget and g3.budget == budget - g2.held_bytes
    assert measured == step_peak([g2, g3], lambda g: g.plan)
    assert optimized.remat.report().predicted_peak == step_peak([g0, g1], lambda g: g.plan)


def test_symbolic_shapes_are_refused_with_what_to_do():
    torch._dynamo.reset()
    model, inputs = build("mlp", layers=2, width=16, batch=8)
    compiled = torch.compile(model, backend=remat.backend(1.0), dynamic=True)
    with pytest.raises(BackendCompilerFailed, match="symbolic sizes.*dynamic=False"):
        compiled(*inputs)
    torch._dynamo.reset()


def test_planning_inside_a_users_profiler_keeps_their_trace(caplog):
    """remat measures kernels with a profiler of its own; inside the user's it must not
    end theirs (their trace came back empty) and says what it could not measure."""
    from torch.profiler import ProfilerActivity, profile

    model, inputs = build("mlp", layers=2, width=16, batch=8)
    optimized = remat.optimize(model, budget=1.0)
    with caplog.at_level(logging.WARNING, logger="remat"):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            optimized(*inputs).backward()
            torch.ones(4).sum()
    assert "inside a torch.profiler session" in caplog.text
    assert any(e.key == "aten::sum" for e in prof.key_averages())


def test_a_graph_run_again_before_its_backward_is_reported(caplog):
    """Plans assume one run of each graph per step: a second forward before the first's
    backward holds both runs' saved values, and remat says so (once). A dropped forward
    and an ordinary step after a backward are not that."""
    torch._dynamo.reset()
    model, inputs = build("mlp", layers=2, width=16, batch=8)
    optimized = remat.optimize(model, budget=1.0)
    with caplog.at_level(logging.WARNING, logger="remat"):
        optimized(*inputs).backward()
        optimized(*inputs)  # never differentiated: its autograd graph is freed at once
        optimized(*inputs).backward()
        kept = optimized(*inputs)
        assert "ran again" not in caplog.text
        optimized(*inputs).backward()
        assert caplog.text.count("remat graph0: ran again while 1 earlier run") == 1
        kept.backward()
        optimized(*inputs)
    assert caplog.text.count("ran again") == 1
    assert "outside the compiled model" not in caplog.text


def test_a_loss_computed_outside_the_model_is_reported(caplog):
    """The model returns logits and the loss is computed eagerly on them: what the loss
    holds (cross-entropy's softmax) is in no plan, and remat says so after the backward."""
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x, y = torch.randn(32, 16), torch.randint(0, 8, (32,))
    optimized = remat.optimize(model, budget=1.0)
    with caplog.at_level(logging.WARNING, logger="remat"):
        logits = optimized(x)
        assert "outside the compiled model" not in caplog.text
        torch.nn.functional.cross_entropy(logits, y).backward()
    assert caplog.text.count("remat graph0: its backward started from the gradient") == 1


class _BranchingBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        y = self.linear(x).relu()
        if y.mean().item() > 100:  # data-dependent: a graph break
            y = -y
        return x + y


class _BreakInALoop(torch.nn.Module):
    """A graph break in each block of a loop: dynamo compiles the block's code as its own
    frame and reruns that graph for every block."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_BranchingBlock() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_a_graph_break_in_a_loop_is_reported(caplog):
    torch._dynamo.reset()
    model, x = _BreakInALoop(), torch.randn(8, 16)
    optimized = remat.optimize(model, budget=1.0)
    with caplog.at_level(logging.WARNING, logger="remat"):
        optimized(x).backward()
    assert "ran again while" in caplog.text and "inside a loop" in caplog.text
    torch._dynamo.reset()


def test_ddp_bucket_graphs_are_one_step(caplog):
    """DDP's optimizer splits the compiled graph at its gradient buckets (one compile id,
    several graphs) and runs each on fake tensors while compiling: the pieces are one
    step, and those fake runs are not runs. On CPU (gloo) DDP itself allocates one copy of
    the gradients during the step, outside remat's plan (eager DDP does too)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch._dynamo.reset()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, inputs = build("gpt", d_model=128)  # 1.7 MB of parameters: two buckets
        ddp = DistributedDataParallel(model, bucket_cap_mb=1)
        optimized = remat.optimize(ddp, budget=1.0)
        with caplog.at_level(logging.WARNING, logger="remat"):
            optimized(*inputs).backward()
            model.zero_grad(set_to_none=True)
            measured = memory.peak(lambda: optimized(*inputs).backward()).peak_bytes
        graphs = optimized.remat.graphs
        assert len(graphs) >= 2 and len({str(g.compile_id) for g in graphs}) == 1
        assert all(g.after == tuple(e.name for e in graphs[:i]) for i, g in enumerate(graphs))
        assert "ran again" not in caplog.text
        # measured: remat's plan to the byte, plus DDP's copy of the gradients and some
        # bytes that vary from run to run (0 B in 8 of 12 fresh processes, 16 B in 3, 212 B
        # in 1, 8,200 B once in CI; not pinned down: likely DDP/gloo work that runs on this
        # thread or gloo's by timing). A piece counted apart or twice is megabytes off.
        gradients = sum(p.numel() * p.element_size() for p in model.parameters())
        extra = measured - optimized.remat.report().predicted_peak - gradients
        assert 0 <= extra <= 16 * 1024
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_fsdp2_trains_and_says_its_step_is_not_planned_whole(caplog):
    """FSDP2's wrapper class overrides ``__new__`` (``copy.copy`` of it raised a TypeError),
    and its per-module hooks break the graph at every sharded block: remat trains it with
    eager's gradients and warns that the one block graph reruns per block."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, inputs = build("gpt")
        reference = copy.deepcopy(model)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optimized = remat.optimize(model, budget=1.0)
        with caplog.at_level(logging.WARNING, logger="remat"):
            optimized(*inputs).backward()
        reference(*inputs).backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-4, atol=1e-5)
        assert "ran again while" in caplog.text
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_dynamo_backend_by_name():
    model, inputs = build("mlp")
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="remat", options={"budget": 0.6}, dynamic=False)
    compiled(*inputs).backward()
    reference(*inputs).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


def test_bad_options_fail_before_tracing():
    model, _ = build("mlp")
    with pytest.raises(ValueError, match="solver"):
        remat.optimize(model, budget=0.5, solver="magic")
    with pytest.raises(ValueError, match="compiler"):
        remat.optimize(model, budget=0.5, compiler="tvm")
    with pytest.raises(ValueError, match="budget"):
        remat.optimize(model, budget="lots")
    with pytest.raises(TypeError):
        remat.optimize(lambda x: x, budget=0.5)


@pytest.mark.slow
def test_inductor_compiler_trains_like_eager_under_the_budget():
    model, inputs = build("mlp", layers=4)
    reference = copy.deepcopy(model)
    optimized = remat.optimize(model, budget=0.7, compiler="inductor")
    losses, grads = train(model, optimized, inputs)
    ref_losses, ref_grads = train(reference, reference, inputs)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for key in grads:
        torch.testing.assert_close(grads[key], ref_grads[key], rtol=1e-4, atol=1e-5)
    model.zero_grad(set_to_none=True)
    peak = memory.peak(lambda: optimized(*inputs).backward()).peak_bytes
    assert peak <= 1.10 * optimized.remat.report().graphs[0].budget


def test_profile_cost_model_plans_with_measured_times():
    model, inputs = build("mlp", layers=3)
    reference = copy.deepcopy(model)
    optimized = remat.optimize(model, budget=0.8, cost_model="profile")
    optimized(*inputs).backward()
    reference(*inputs).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    problem = optimized.remat.report().graphs[0].extracted.problem
    matmuls = [n for n in problem.nodes if n.op in ("addmm.default", "mm.default")]
    assert matmuls and all(n.cost > 0 for n in matmuls)
    estimated = remat.plan(reference, inputs, budget=0.8).graphs[0].extracted.problem
    assert [n.name for n in estimated.nodes] == [n.name for n in problem.nodes]
    assert [n.cost for n in estimated.nodes] != [n.cost for n in problem.nodes]
