"""The Hugging Face Trainer on batches padded to their longest row: remat against the
uncompiled Trainer, step by step.

    python benchmarks/trainer_lengths.py --steps 24 --budget 0.6 --json out/trainer.json

The model, data and arguments are ``examples/hf_trainer.py``'s (a tiny GPT-2, rows of 16
to 128 tokens, batches of four). Both runs see the same batches in the same order; each
step is timed by a Trainer callback. Prints the steps, then the summary: losses equal, the
median step against eager's, the slowest step that did not trace against eager's
median, and the traces and plans remat made (``REMAT_CACHE=0`` times planning).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _output import write_rows
from tabulate import tabulate
from transformers import Trainer, TrainerCallback

import remat

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import hf_trainer  # noqa: E402  (the example's model, data and arguments)


class _Clock(TrainerCallback):
    """Each training step's wall time and, for remat's model, whether it traced (a new
    dynamo compile) or planned (a new graph plan)."""

    def __init__(self, rb=None) -> None:
        self.rb, self.steps = rb, []
        self.traces = self.plans = 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        seconds = time.perf_counter() - self.start
        traces = len({g.compile_id for g in self.rb.graphs}) if self.rb else 0
        plans = len(self.rb.graphs) if self.rb else 0
        self.steps.append((seconds, traces > self.traces, plans > self.plans))
        self.traces, self.plans = traces, plans


def train(steps: int, budget: str | None):
    """Losses and per step (seconds, traced, planned) of one run (``budget`` None:
    uncompiled), and remat's report."""
    model, args = hf_trainer.model_and_args(steps, tempfile.mkdtemp())
    given = model if budget is None else remat.optimize(model, budget=budget)
    clock = _Clock(getattr(given, "remat", None))
    trainer = Trainer(
        model=given, args=args, train_dataset=hf_trainer.dataset(4 * steps),
        data_collator=hf_trainer.collate, callbacks=[clock],
    )  # fmt: skip
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, clock.steps, None if budget is None else given.remat.report()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--budget", default="0.6")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--csv", type=Path)
    args = parser.parse_args(argv)

    eager_losses, eager_steps, _ = train(args.steps, None)
    losses, steps, report = train(args.steps, args.budget)
    eager_s = [s for s, _, _ in eager_steps]
    rows = [
        {"step": k + 1, "eager s": e, "remat s": s, "remat work": _work(traced, planned),
         "eager loss": el, "remat loss": rl}
        for k, (e, (s, traced, planned), el, rl)
        in enumerate(zip(eager_s, steps, eager_losses, losses, strict=True))
    ]  # fmt: skip
    print(tabulate(rows, headers="keys", floatfmt=".4g"))
    median = statistics.median(eager_s)
    not_tracing = [s for s, traced, _ in steps if not traced]
    summary = {
        "steps": args.steps,
        "losses equal": losses == eager_losses,
        "eager median s": median,
        "remat median s": statistics.median(s for s, _, _ in steps),
        "median ratio": statistics.median(s for s, _, _ in steps) / median,
        "traces": sum(traced for _, traced, _ in steps),
        "plans": sum(planned for _, _, planned in steps),
        "slowest step not tracing / eager median": max(not_tracing, default=0.0) / median,
    }
    print()
    print(tabulate([summary], headers="keys", floatfmt=".3g"))
    write_rows([*({"kind": "step", **r} for r in rows), {"kind": "summary", **summary}],
               args.json, args.csv)  # fmt: skip
    return 0


def _work(traced: bool, planned: bool) -> str:
    return "trace+plan" if traced else "plan" if planned else ""


if __name__ == "__main__":
    sys.exit(main())
