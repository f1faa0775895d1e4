"""What the CPU allocator's fresh pages cost a training step, beside remat's estimate: one
model trained under each allocator setting in a process of its own, its steps timed with
the minor page faults each took.

    python benchmarks/page_faults.py [MODEL] [--size KEY=VALUE ...] [--budgets 1.0,0.5]
        [--threads 1] [--steps 9] [--json out/page_faults.json]

glibc (Linux) hands freed memory back to the kernel once the free top of its heap passes
a trim threshold, and maps every block above an mmap threshold afresh; both thresholds
rise with what a process frees, to 64 MiB and 32 MiB. A step then touches again pages it
held a step before, and the kernel faults and zeroes each. The settings: "glibc
defaults", and "heap kept", ``MALLOC_TRIM_THRESHOLD_`` at 1 TiB and
``MALLOC_MMAP_THRESHOLD_`` at 32 MiB in the environment of the process (glibc reads them
when the process starts), so freed memory stays in the heap for the next step.

Per setting and budget: a fresh ``remat.optimize`` (plan cache off), two untimed steps,
then ``--steps`` timed ones: their median, spread ((max - min) / median), the median of
their minor page faults (``getrusage``), and the plan's estimate. Linux only.
Results: docs/benchmarks.md, "Page faults in a CPU step".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _output import finished, shown, step_parser, warmed_up  # noqa: E402

SETTINGS = {
    "glibc defaults": {},
    "heap kept": {"MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)},
}


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure(model_spec: str, size: dict, budget: float, steps: int) -> dict:
    """One budget's row, in this process."""
    model, inputs, optimized = warmed_up(model_spec, size, budget)
    times, faults = [], []
    for _ in range(steps):
        before, start = minor_faults(), time.perf_counter()
        optimized(*inputs).backward()
        times.append(time.perf_counter() - start)
        faults.append(minor_faults() - before)
        model.zero_grad(set_to_none=True)
    step = statistics.median(times)
    estimate = sum(g.step_seconds for g in optimized.remat.report().graphs)
    return {
        "budget": budget,
        "step_s": step,
        "spread": (max(times) - min(times)) / step,
        "faults per step": statistics.median(faults),
        "estimated_s": estimate,
        "error": estimate / step - 1,
    }


def child(args: argparse.Namespace) -> int:
    """Measure every budget here and print the rows as one JSON line."""
    torch.set_num_threads(args.threads)
    budgets = [float(b) for b in args.budgets.split(",")]
    rows = [measure(args.model, dict(args.size), b, args.steps) for b in budgets]
    print(json.dumps(rows))
    return 0


def main(argv=None) -> int:
    parser = step_parser(__doc__, "hf-gpt2", "1.0,0.5", 9)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    sizes = [part for key, value in args.size for part in ("--size", f"{key}={value}")]
    command = [sys.executable, __file__, args.model, *sizes, "--budgets", args.budgets]
    command += ["--threads", str(args.threads), "--steps", str(args.steps), "--child"]
    rows: list[dict] = []
    for setting, env in SETTINGS.items():
        out = subprocess.run(
            command,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=True,
        )
        for row in json.loads(out.stdout.splitlines()[-1]):
            shown(rows, {"model": args.model, "allocator": setting, **row})
    finished(rows, args.json, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
