"""remat's fast tests and the README's main job on other torch releases, each in a
virtualenv of its own.

    python benchmarks/torch_versions.py [--versions 2.11.0,2.14.1,2.15.0] [--venvs DIR]
        [--json out/torch_versions.json]

Per version, in ``DIR/torch-VERSION`` (default: a temporary folder, removed at the end):

1. ``pip install torch==VERSION`` from the registry, with any pip constraint lifted
   (``PIP_CONSTRAINT`` set to an empty file: a machine's cap on torch would replace the
   version asked for); a virtualenv already there with that torch is reused;
2. ``pip install -e '.[dev]'`` of this checkout, which must keep that torch (the
   requirement's range admits every supported release; the row's ``torch kept`` says
   whether pip left it alone, the check a user installing beside their own torch needs);
3. ``python -m pytest -m "not slow"`` (counts from its JUnit XML);
4. ``remat train gpt --budget 50%``, the README's main job: ok when it exits 0, its
   measured peak is within the budget and its losses are eager's.

It prints a table and writes the rows as JSON; ``python benchmarks/report.py record
torch_versions FILE --command "..."`` puts them on docs/benchmarks.md ("torch versions").
The script drives other interpreters only: it runs on any Python 3.10+ without packages.

Why a script in benchmarks/ and not in .ci/: it writes a results file the benchmark page
renders, like the other scripts here, and it parses test reports and times phases, which
Python does plainly.

Why CI runs none of it: CI (``.ci/run``) runs the full suite on torch 2.13, the CI's
release, and must stay well under 20 minutes. One more release costs its fast subset
(``fast tests s`` in docs/benchmarks.md, "torch versions": most of the time CI's whole
suite takes) plus downloading a multi-GB CUDA build: past the limit. So the other
releases are checked here by hand, whenever ``passes/_torch_compat.py`` or the supported
range changes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VERSIONS = ("2.11.0", "2.14.1", "2.15.0")  # 2.13.0 is CI's (.ci/run)
MAIN_JOB = ("train", "gpt", "--budget", "50%")
COLUMNS = (
    ("torch", "torch"),
    ("torch kept", "torch kept"),
    ("passed", "passed"),
    ("failed", "failed"),
    ("skipped", "skipped"),
    ("tests s", "tests s"),
    ("main job", "main job"),
    ("main job s", "main job s"),
)


def run(command: list[str], *, cwd: Path = ROOT, env: dict | None = None) -> tuple[int, str]:
    """``command``'s exit status and its output (stdout and stderr together)."""
    done = subprocess.run(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return done.returncode, done.stdout


def pip_environment(no_constraint: Path) -> dict:
    """The environment pip runs in: no constraint file, no PYTHONPATH of the caller's."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PIP_CONSTRAINT"] = str(no_constraint)
    return env


def installed_torch(python: Path) -> str | None:
    """The torch version ``python`` imports, None where it has none."""
    if not python.exists():
        return None
    status, out = run([str(python), "-c", "import torch; print(torch.__version__)"])
    return out.strip().splitlines()[-1] if status == 0 else None


def release(version: str) -> str:
    """``2.11.0+cu130`` -> ``2.11.0``."""
    return version.split("+")[0]


def prepare(venv: Path, version: str, env: dict) -> tuple[str, float]:
    """A virtualenv with torch ``version`` and this checkout installed editable; the torch
    it has after the install, and the seconds it took."""
    start = time.perf_counter()
    python = venv / "bin" / "python"
    if release(installed_torch(python) or "") != version:
        must(run([sys.executable, "-m", "venv", "--clear", str(venv)]), f"venv {venv}")
        must(run([str(python), "-m", "pip", "install", "-q", f"torch=={version}"], env=env),
             f"torch {version}")  # fmt: skip
    must(run([str(python), "-m", "pip", "install", "-q", "-e", ".[dev]"], env=env), "remat")
    return installed_torch(python) or "none", time.perf_counter() - start


def must(result: tuple[int, str], what: str) -> None:
    status, out = result
    if status != 0:
        raise SystemExit(f"installing {what} failed:\n{out[-3000:]}")


def fast_tests(python: Path, report: Path) -> dict:
    """``pytest -m "not slow"``: counts of passed, failed (errors too) and skipped tests,
    the failed ones' names, and the seconds it took."""
    start = time.perf_counter()
    command = [str(python), "-m", "pytest", "-m", "not slow", "-q", "-p", "no:cacheprovider"]
    _status, out = run([*command, f"--junitxml={report}"])
    seconds = time.perf_counter() - start
    if not report.exists():
        return {"passed": 0, "failed": None, "skipped": None, "tests s": seconds,
                "failures": [out[-2000:]]}  # fmt: skip
    suites = ET.parse(report).getroot()
    totals = {k: 0 for k in ("tests", "failures", "errors", "skipped")}
    failures = []
    for suite in suites.iter("testsuite"):
        for k in totals:
            totals[k] += int(suite.get(k, 0))
    for case in suites.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failures.append(f"{case.get('classname')}::{case.get('name')}")
    failed = totals["failures"] + totals["errors"]
    return {
        "passed": totals["tests"] - failed - totals["skipped"],
        "failed": failed,
        "skipped": totals["skipped"],
        "tests s": seconds,
        "failures": failures,
    }


def main_job(venv: Path, workdir: Path) -> dict:
    """The README's main job: its verdict and the line saying its measured peak."""
    start = time.perf_counter()
    status, out = run([str(venv / "bin" / "remat"), *MAIN_JOB], cwd=workdir)
    seconds = time.perf_counter() - start
    peak = next((line for line in out.splitlines() if line.startswith("measured peak:")), "")
    losses = next((line for line in out.splitlines() if line.startswith("losses:")), "")
    if status != 0:
        verdict = f"exit status {status}: {out.strip().splitlines()[-1] if out.strip() else ''}"
    elif "within the budget: yes" not in peak:
        verdict = "over the budget"
    elif not losses.startswith(("losses: remat's equal", "losses: remat's match")):
        verdict = "losses differ"
    else:
        verdict = "ok"
    return {"main job": verdict, "main job s": seconds, "measured peak": peak, "losses": losses}


def check(version: str, venvs: Path, no_constraint: Path) -> dict:
    """One version's row."""
    venv = venvs / f"torch-{version}"
    print(f"== torch {version}: installing in {venv}", file=sys.stderr, flush=True)
    torch, install_s = prepare(venv, version, pip_environment(no_constraint))
    row = {"torch": version, "installed": torch, "torch kept": release(torch) == version}
    row["install s"] = install_s
    print(f"== torch {version}: fast tests", file=sys.stderr, flush=True)
    row.update(fast_tests(venv / "bin" / "python", venv / "junit.xml"))
    print(f"== torch {version}: the main job", file=sys.stderr, flush=True)
    row.update(main_job(venv, venvs))
    return row


def table(rows: list[dict]) -> str:
    """The rows' main columns, aligned."""

    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.0f}"
        return "" if value is None else str(value)

    body = [[h for h, _ in COLUMNS]] + [[cell(r.get(k)) for _, k in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in body) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--versions",
        default=",".join(DEFAULT_VERSIONS),
        help=f"torch releases, comma-separated (default {','.join(DEFAULT_VERSIONS)})",
    )
    parser.add_argument(
        "--venvs", type=Path, help="folder of the virtualenvs, kept (default: a temporary one)"
    )
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    versions = [v.strip() for v in args.versions.split(",") if v.strip()]
    with tempfile.TemporaryDirectory() as scratch:
        venvs = (args.venvs or Path(scratch)).resolve()
        venvs.mkdir(parents=True, exist_ok=True)
        no_constraint = Path(scratch) / "no-constraint.txt"
        no_constraint.write_text("")
        rows = [check(v, venvs, no_constraint) for v in versions]
    print(table(rows))
    for row in rows:
        for name in row["failures"]:
            print(f"torch {row['torch']}: FAILED {name}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    ok = all(r["torch kept"] and r["failed"] == 0 and r["main job"] == "ok" for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
