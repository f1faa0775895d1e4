"""Fuzzing remat with random models (``fuzz.models``): each trains two SGD steps under a
random budget beside an eager copy, with eager's losses, gradients, buffers and RNG
state, a plan within the budget and a measured peak equal to the predicted one.

Profiles: ``fuzz-ci`` (the default, part of ``python -m pytest``: 200 models, derandomized
so CI runs the same ones every time, about 4 minutes on two cores) and ``fuzz-long``
(``REMAT_FUZZ=long python -m pytest tests/api/test_fuzz.py``: 2,000 models, a new draw
each run; ``--hypothesis-seed=N`` repeats one).
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import remat
from remat import memory

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ``fuzz`` beside this file
import fuzz  # noqa: E402

settings.register_profile(
    "fuzz-ci",
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "fuzz-long",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
PROFILE = settings.get_profile("fuzz-long" if os.environ.get("REMAT_FUZZ") == "long" else "fuzz-ci")

STEPS = 2
LR = 0.01  # small: products of activations (x @ x.T twice) make large gradients
RTOL, ATOL = 1e-4, 1e-5  # float32: recomputation and reordering change rounding only
# remat over-predicts a step holding batch norm by a few hundred bytes (a known
# over-prediction, as in the CNN example); an under-prediction is never allowed.
BATCHNORM_SLACK = 8192


def _loss(out):
    return out[0] if isinstance(out, tuple) else out


def _finite(value) -> bool:
    values = value if isinstance(value, tuple) else (value,)
    return all(bool(torch.isfinite(v).all()) for v in values)


def _close(actual, expected, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


class _Trainer:
    """A model, its inputs and its SGD optimizer (none for a model without parameters)."""

    def __init__(self, spec: fuzz.ModelSpec, model: torch.nn.Module, run) -> None:
        self.model, self.run = model, run
        self.inputs = spec.inputs()
        params = list(model.parameters())  # a model may have none (x needs a gradient)
        self.opt = torch.optim.SGD(params, lr=LR) if params else None

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.inputs[0].grad = None

    def opt_step(self) -> None:
        if self.opt is not None:
            self.opt.step()

    def forward_backward(self):
        out = self.run(*self.inputs)
        _loss(out).backward()
        return out

    def grads(self) -> dict[str, torch.Tensor]:
        named = dict(self.model.named_parameters())
        named["<input>"] = self.inputs[0]
        return {k: p.grad for k, p in named.items() if p.grad is not None}


class _Overflowed(Exception):
    """Eager training of the model overflowed (inf, NaN): nothing to compare."""


def _check(spec: fuzz.ModelSpec, budget) -> None:
    """Train under ``budget`` beside eager; raise ``InfeasibleBudget`` if remat refuses it."""
    torch.compiler.reset()  # no dynamo cache or recompile count carries over between models
    # what earlier models left (torch keeps a few hundred objects per compiled model) is
    # set aside from later collections: a recorded step's full collection (``Recording``)
    # then costs what it does in a fresh process, not more with every model drawn
    gc.collect()
    gc.freeze()
    model = spec.build()
    reference = copy.deepcopy(model)
    ours = _Trainer(spec, model, remat.optimize(model, budget=budget))
    eager = _Trainer(spec, reference, reference)
    measured = None
    for step in range(STEPS):
        # the same seed before each step: dropout draws the same masks in both
        ours.zero_grad()
        torch.manual_seed(100 + step)
        if step == STEPS - 1:  # from the second step on, the step's joint plan runs
            measurement = memory.peak(ours.forward_backward)
            out, measured = measurement.result, measurement.peak_bytes
        else:
            out = ours.forward_backward()
        rng = torch.get_rng_state()
        eager.zero_grad()
        torch.manual_seed(100 + step)
        ref_out = eager.forward_backward()
        ref_rng = torch.get_rng_state()
        if not all(_finite(t) for t in (ref_out, *eager.grads().values())):
            raise _Overflowed(step)

        _close(out, ref_out, f"step {step} outputs")
        grads, ref_grads = ours.grads(), eager.grads()
        assert grads.keys() >= ref_grads.keys(), (step, sorted(grads), sorted(ref_grads))
        for key in ref_grads:
            _close(grads[key], ref_grads[key], f"step {step} gradient of {key}")
        for key in grads.keys() - ref_grads.keys():
            # AOTAutograd (torch.compile's, remat or not) gives zeros where eager leaves
            # None: a parameter only a returned value the loss does not read depends on
            assert not grads[key].any(), f"step {step}: {key} has a gradient eager lacks"
        # a replayed dropout restores the generator: the step leaves it where eager does
        assert torch.equal(rng, ref_rng), f"step {step}: RNG state differs from eager's"
        ours.opt_step()
        eager.opt_step()

    for (key, p), (_, q) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        _close(p, q, f"parameter {key}")
    for (key, b), (_, c) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
        _close(b, c, f"buffer {key}")

    report = ours.run.remat.report()
    assert report.steps, "the first step ended without a step plan"
    for s in report.steps:
        assert s.plan.peak <= s.limit, (s.graphs, s.plan.peak, s.limit)
    predicted = report.predicted_peak
    if spec.has_batchnorm:
        assert 0 <= predicted - measured <= BATCHNORM_SLACK, (predicted, measured)
    else:
        assert measured == predicted, (measured, predicted)


def check_model(spec: fuzz.ModelSpec, fraction: float) -> None:
    """``_check`` at ``fraction`` of the store-all peak; if remat refuses it, the minimum
    it names is above the budget and a retry there passes every check."""
    log = logging.getLogger("remat")
    level = log.level
    log.setLevel(logging.ERROR)  # a first step over its graph's share warns by design
    try:
        _check(spec, fraction)
    except remat.InfeasibleBudget as refused:
        assert refused.minimum > refused.limit, (refused.minimum, refused.limit)
        _check(spec, f"{refused.minimum}B")  # as the refusal says to write it
    finally:
        log.setLevel(level)


@pytest.mark.slow
@settings(PROFILE)
@given(spec=fuzz.models(), fraction=st.floats(0.3, 1.0))
def test_random_models_train_as_eager_within_the_budget(spec, fraction):
    try:
        check_model(spec, fraction)
    except _Overflowed:
        assume(False)  # drawn again: a model eager cannot train says nothing


# Models the long profile found failing, kept as cases: BatchNorm1d over a transposed
# sequence, whose real output is laid out otherwise than the traced one, so the linear
# layer's traced view is a copy at run time, and a convolution after it copies its input
# (passes/layouts.py)
def _found(source: str) -> fuzz.ModelSpec:
    """A found model on the input it failed with."""
    return fuzz.ModelSpec(
        source=textwrap.dedent(source),
        seed=0,
        x_shape=(4, 2, 8),
        x_requires_grad=False,
        families=frozenset({"batchnorm"}),
    )


FOUND = [
    _found(
        """
        class FuzzModel(nn.Module):
            def __init__(self):
                super().__init__()
                self.m1 = nn.BatchNorm1d(8)
                self.m2 = nn.Linear(8, 4)

            def forward(self, v0, ids, idx, gidx):
                v1 = v0.transpose(1, 2)
                v2 = self.m1(v1)
                v3 = v2.transpose(1, 2)
                v4 = self.m2(v3)
                return v4.square().mean()
        """
    ),
    _found(  # the difference carried on by a relu to a convolution, which copies
        """
        class FuzzModel(nn.Module):
            def __init__(self):
                super().__init__()
                self.m1 = nn.BatchNorm1d(8)
                self.m2 = nn.Linear(2, 4)
                self.m3 = nn.Conv1d(2, 2, 3, padding=1)
                self.m4 = nn.Linear(8, 4)

            def forward(self, v0, ids, idx, gidx):
                v3 = torch.relu(self.m1(v0.transpose(1, 2)))
                v4 = self.m2(v3)
                v7 = self.m4(self.m3(v3.transpose(1, 2)))
                return v7.square().mean() + v4.square().mean()
        """
    ),
    # the kernels after the difference meet it too: gelu's backward, measured on inputs
    # laid out as traced, allocated a second buffer when laid out as at run time
    # (costs.measured.run_layouts); 1,992 B measured against 1,592 predicted before
    _found(
        """
        class FuzzModel(nn.Module):
            def __init__(self):
                super().__init__()
                self.m1 = nn.BatchNorm1d(2)
                self.m2 = nn.BatchNorm1d(8)
                self.m3 = nn.Linear(8, 4)
                self.m4 = nn.Linear(8, 4)

            def forward(self, v0, ids, idx, gidx):
                v3 = self.m2(self.m1(v0).transpose(1, 2))
                v7 = self.m3(F.gelu(v3).transpose(1, 2)).flatten(1)
                return v7.index_select(-1, idx).square().mean() + self.m4(v7).square().mean()
        """
    ),
]


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize(
    "spec", FOUND, ids=["batchnorm-transposed", "then-relu-conv", "then-gelu-backward"]
)
def test_found_models_train_as_eager_within_the_budget(spec, fraction):
    check_model(spec, fraction)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(spec=fuzz.models())
def test_generated_models_run_eagerly(spec):
    """Every drawn model is legal PyTorch: its forward and backward run eagerly (an
    in-place op never overwrites what autograd saved)."""
    _loss(spec.build()(*spec.inputs())).backward()


def test_the_strategy_draws_every_op_family():
    seen: set[str] = set()

    @settings(max_examples=300, deadline=None, derandomize=True, database=None)
    @given(spec=fuzz.models())
    def collect(spec):
        seen.update(spec.families)

    collect()
    assert seen >= {*fuzz.FAMILIES, "second output"}, set(fuzz.FAMILIES) - seen


# ----------------------------------------------------------------------------- regressions
# Models the fuzzer found, shrunk and kept: each failed before the fix it names.


def _spec(source: str, x_shape=(fuzz.BATCH, 8), x_requires_grad=False) -> fuzz.ModelSpec:
    return fuzz.ModelSpec(textwrap.dedent(source).strip() + "\n", 0, x_shape, x_requires_grad)


@pytest.mark.slow
def test_a_norm_of_the_input_plans_below_the_single_recomputation_floor():
    """A multi-output op on resident inputs alone (layer norm of the model's input) was
    taken for a free value by the chain search, so the revolve plans ``auto`` tries below
    the single-recomputation floor handed the op itself over: InvalidPlan."""
    spec = _spec(
        """
        class FuzzModel(nn.Module):
            def __init__(self):
                super().__init__()
                self.m1 = nn.LayerNorm(8)
                self.m2 = nn.Linear(8, 8)

            def forward(self, v0, ids, idx, gidx):
                v1 = self.m1(v0)
                v2 = torch.tanh(self.m2(v1))
                return v2.square().mean()
        """
    )
    check_model(spec, 0.3)


@pytest.mark.slow
def test_a_returned_slice_gets_a_tangent_of_its_strided_size():
    """The tangent of a returned 4x7 slice of a 4x8 matrix is allocated with the slice's
    strides (124 bytes, not 112) and lives through the backward: predicted 12 bytes low."""
    spec = _spec(
        """
        class FuzzModel(nn.Module):
            def __init__(self):
                super().__init__()
                self.m1 = nn.Linear(8, 8)
                self.m2 = nn.Linear(1, 64)

            def forward(self, v0, ids, idx, gidx):
                v1, v2 = self.m1(v0).split([1, 7], -1)
                return torch.tanh(self.m2(v1)).square().mean(), v2
        """
    )
    check_model(spec, 1.0)


@pytest.mark.slow
def test_an_output_handed_over_dies_at_its_last_read_before_its_op_re_runs():
    """Layer norm's output is saved, its statistics are not: the backward re-runs the op
    after the output's last read. The simulator held the saved output until the re-run
    (as if the kernel read it) and predicted 32 bytes over the measured peak."""
    spec = _spec(
        """
        class FuzzModel(nn.Module):
            def __init__(self):
                super().__init__()
                self.m1 = nn.Conv1d(2, 2, 3, padding=1)
                self.m3 = nn.LayerNorm(1)
                self.m5 = nn.Conv1d(2, 2, 3, padding=1)

            def forward(self, v0, ids, idx, gidx):
                v1 = v0.permute(0, 1, 2).contiguous()
                v2 = self.m1(v1)
                v6, v7 = v2.split([1, 7], -1)
                v8 = self.m3(v6)
                v10 = self.m5(v0)
                return v10.square().mean() + v8.square().mean() + v7.square().mean()
        """,
        x_shape=(fuzz.BATCH, 2, 8),
    )
    check_model(spec, 0.33)


# Found by the long profile on 2026-12-05 (--hypothesis-seed=20261205002): BatchNorm1d over
# one half of a split of a transposed input, then a convolution. At 1.0 it measured
# 27,504 B against 25,136 B predicted: the fake batch norm's output, (4, 8, 1) of strides
# (8, 1, 8), is contiguous to torch, so its real strides (8, 1, 1) were not looked for,
# and the convolution was measured on a channels-last input, another kernel with other
# scratch (passes/layouts.py)
SPLIT_THEN_CONV = _found(
    """
    class FuzzModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.m1 = nn.Linear(16, 4)
            self.m2 = nn.BatchNorm1d(4)
            self.m3 = nn.Linear(4, 4)
            self.m4 = nn.BatchNorm1d(8)
            self.m5 = nn.Conv1d(8, 2, 3, padding=1)

        def forward(self, v0, ids, idx, gidx):
            v3 = v0.transpose(1, 2).transpose(1, 2).transpose(1, 2)
            v7 = self.m3(self.m2(self.m1(v3.flatten(1))))
            v8, v9 = v3.split([1, 1], -1)
            v11 = self.m5(self.m4(v9))
            return v11.square().mean() + v8.square().mean() + v7.square().mean()
    """
)


def test_a_split_of_a_transposed_input_then_batchnorm_and_conv_measures_its_prediction():
    check_model(SPLIT_THEN_CONV, 1.0)


# Found by the long profile on 2026-12-05 (--hypothesis-seed=20261205103): the input's
# gradient is its transpose, laid out otherwise than the input, so autograd copies it into
# ``.grad`` beside the backward's outputs (passes.layouts.copied_into_grad). The first
# step's refusal at 0.5 named 1,544 B, the graph's minimum without that copy; a retry there
# was refused at the step's end naming 1,640 B.
INPUT_GRAD_MINIMUM = _spec(
    """
    class FuzzModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.m1 = nn.Embedding(10, 8)
            self.m2 = nn.Linear(8, 8)

        def forward(self, v0, ids, idx, gidx):
            v2 = self.m2(self.m1(ids))
            v3 = v0.transpose(1, 2)
            return v2.index_select(-1, idx).square().mean() + v3.square().mean()
    """,
    x_shape=(4, 2, 4, 4),
    x_requires_grad=True,
)


def test_a_refusal_names_a_minimum_a_retry_there_fits_with_the_inputs_gradient():
    check_model(INPUT_GRAD_MINIMUM, 0.5)
