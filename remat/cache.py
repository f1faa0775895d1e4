"""Plans on disk, so a restarted job skips the kernel measurements and solves an earlier
process made (tracing still runs: dynamo has no cache for it).

Three kinds of entry, one JSON file each, named by the hash of what determines it
(``remat.keys``):

- ``problem-<key>.json``: a joint graph's ``Problem``, with the bytes and times measured
  on the device;
- ``plan-<key>.json``: the values a solver chose to save (and its backward order), under
  one budget in bytes;
- ``candidates-<key>.json``: the values torch's own partition of the graph saves (a
  candidate plan, ``remat.planner``), so a restarted process does not partition again.

No entry is taken on faith. A problem must name the graph's nodes in order; a plan is
derived again from its saved values (``evaluate``), must come out at the peak and cost it
was stored with, and then goes through ``solvers.solve``'s check like any solver's; so
does a candidate. An entry that cannot be read or does not match is ignored with a debug
log and rebuilt.
Writes go to a temporary file in the same folder and then ``os.replace``: a reader sees
the old entry or the whole new one, so processes planning at once never corrupt it.

Where: ``REMAT_CACHE_DIR``, else ``$XDG_CACHE_HOME/remat``, else ``~/.cache/remat``.
Off: ``REMAT_CACHE=0``, or ``cache=False`` to ``remat.optimize``/``remat.backend``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch import fx

from remat.keys import candidates_key, plan_key, problem_key, solver_key
from remat.passes.extract import Extracted, problem_nodes
from remat.solvers import Node, Plan, Problem, evaluate
from remat.solvers.solve import solver_for

log = logging.getLogger("remat")

FORMAT = 1  # bumped when an entry's layout changes; other formats are ignored
CacheLike = bool | str | os.PathLike | None
OFF = ("0", "false", "off", "no")  # values of REMAT_CACHE that turn the cache off


def default_dir() -> Path:
    """``REMAT_CACHE_DIR``, else the user's cache folder (XDG) joined with ``remat``."""
    if os.environ.get("REMAT_CACHE_DIR"):
        return Path(os.environ["REMAT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "remat"


def open_cache(option: CacheLike = None) -> PlanCache | None:
    """The cache ``option`` asks for: None (the default) means on unless ``REMAT_CACHE=0``,
    True on, False off, a path on in that folder."""
    if option is False:
        return None
    if option is None or option is True:
        if option is None and os.environ.get("REMAT_CACHE", "1").strip().lower() in OFF:
            return None
        return PlanCache(default_dir())
    return PlanCache(Path(option))


class PlanCache:
    """Problems and plans in one folder; ``counts`` says how many of each were found
    (``problem hit``, ``plan hit``), planned anew (``... miss``) or refused (``... bad``)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.counts: Counter[str] = Counter()

    # ------------------------------------------------------------------ problems

    def extracted(
        self,
        joint: fx.GraphModule,
        num_fwd_outputs: int,
        cost_model: str,
        device: torch.device,
        name: str,
        build: Callable[[], Extracted],
    ) -> Extracted:
        """``joint``'s problem (named ``name``) from the cache, else ``build()``'s, stored."""
        key = problem_key(joint, num_fwd_outputs, cost_model, device)
        nodes = problem_nodes(joint)
        problem = self.problem(key, [n.name for n in nodes])
        if problem is not None:
            return Extracted(dataclasses.replace(problem, name=name), nodes)
        extracted = build()
        self.store_problem(key, extracted.problem)
        return extracted

    def problem(self, key: str, names: list[str]) -> Problem | None:
        """The stored problem under ``key`` if its nodes are ``names``, in order."""
        entry = self._read("problem", key)
        if entry is None:
            return None
        try:
            problem = _problem_from(entry["problem"])
        except (KeyError, TypeError, ValueError) as e:
            return self._bad("problem", key, f"unreadable problem ({e})")
        if [n.name for n in problem.nodes] != names:
            return self._bad("problem", key, "its nodes are not this graph's")
        self.counts["problem hit"] += 1
        return problem

    def store_problem(self, key: str, problem: Problem) -> None:
        self._write("problem", key, {"problem": _problem_to(problem)})

    # ------------------------------------------------------------------ plans

    def solver(self, solver: str | Callable) -> Callable[[Problem, int], Plan]:
        """``solver`` (what ``solve`` takes) answering from the cache where it can, storing
        what it plans; ``solver`` itself where it has no name stable across processes."""
        name = solver_key(solver)
        if name is None:
            return solver
        run = solver_for(solver)

        def cached(problem: Problem, limit: int) -> Plan:
            key = plan_key(problem, limit, name)
            plan = self._plan(key, problem, limit)
            if plan is None:
                plan = run(problem, limit)
                if isinstance(plan, Plan):
                    self._write("plan", key, _plan_to(plan))
            return plan

        cached.__name__ = getattr(run, "__name__", name)
        return cached

    def _plan(self, key: str, problem: Problem, limit: int) -> Plan | None:
        entry = self._read("plan", key)
        if entry is None:
            return None
        try:
            plan = evaluate(
                problem,
                entry["saved"],
                backward=entry["backward"],
                solver=entry["solver"],
                status=entry["status"],
                limit=entry["limit"],
                bound=entry["bound"],
            )
        except Exception as e:  # a foreign entry may name nodes this problem lacks
            return self._bad("plan", key, f"cannot be scheduled ({type(e).__name__}: {e})")
        if (plan.peak, plan.recompute_cost) != (entry["peak"], entry["recompute_cost"]):
            return self._bad("plan", key, "its saved values no longer give its peak and cost")
        if plan.peak > limit:
            return self._bad("plan", key, f"its peak {plan.peak} is over the budget {limit}")
        self.counts["plan hit"] += 1
        return plan

    # ------------------------------------------------------------------ candidates

    def candidates(
        self,
        joint: fx.GraphModule,
        num_fwd_outputs: int,
        build: Callable[[], dict[str, frozenset[int]]],
    ) -> dict[str, frozenset[int]]:
        """``joint``'s candidate saved sets by name from the cache, else ``build()``'s,
        stored. Each is checked where it is used (``solvers.solve``), as a solver's plan."""
        key = candidates_key(joint, num_fwd_outputs)
        entry = self._read("candidates", key)
        if entry is not None:
            try:
                found = {str(k): frozenset(int(i) for i in v) for k, v in entry["saved"].items()}
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                self._bad("candidates", key, f"unreadable ({e})")
            else:
                self.counts["candidates hit"] += 1
                return found
        found = build()
        self._write("candidates", key, {"saved": {k: sorted(v) for k, v in found.items()}})
        return found

    def figures(self, key: str, build: Callable[[], dict]) -> dict:
        """The machine's calibration figures under ``key`` (``costs.calibration``), else
        ``build()``'s, stored."""
        entry = self._read("calibration", key)
        if entry is not None and isinstance(entry.get("figures"), dict):
            self.counts["calibration hit"] += 1
            return entry["figures"]
        found = build()
        self._write("calibration", key, {"figures": found})
        return found

    # ------------------------------------------------------------------ files

    def _path(self, kind: str, key: str) -> Path:
        return self.directory / f"{kind}-{key}.json"

    def _read(self, kind: str, key: str) -> dict | None:
        path = self._path(kind, key)
        try:
            entry = json.loads(path.read_text())
        except FileNotFoundError:
            self.counts[f"{kind} miss"] += 1
            return None
        except (OSError, ValueError) as e:
            return self._bad(kind, key, f"unreadable ({e})")
        if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != key:
            return self._bad(kind, key, "not an entry of this format and key")
        return entry

    def _bad(self, kind: str, key: str, why: str) -> None:
        self.counts[f"{kind} bad"] += 1
        log.debug("remat cache: %s entry %s ignored and planned again: %s", kind, key, why)
        return None

    def _write(self, kind: str, key: str, entry: dict) -> None:
        """Write atomically; a cache that cannot be written (read-only, full) is logged,
        never an error: planning succeeded."""
        entry = {"format": FORMAT, "key": key, **entry}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{kind}-", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(entry, f)
                os.replace(tmp, self._path(kind, key))
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            log.debug("remat cache: could not write %s entry %s: %s", kind, key, e)


def _problem_to(problem: Problem) -> dict:
    return {
        "nodes": [dataclasses.astuple(n) for n in problem.nodes],
        "outputs": problem.outputs,
        "grads": problem.grads,
        "resident_bytes": problem.resident_bytes,
        "name": problem.name,
    }


def _problem_from(data: dict) -> Problem:
    fields = [f.name for f in dataclasses.fields(Node)]
    nodes = []
    for row in data["nodes"]:
        node = dict(zip(fields, row, strict=True))
        node["inputs"] = tuple(node["inputs"])
        nodes.append(Node(**node))
    return Problem(
        tuple(nodes),
        outputs=tuple(data["outputs"]),
        grads=tuple(data["grads"]),
        resident_bytes=data["resident_bytes"],
        name=data["name"],
    )


def _plan_to(plan: Plan) -> dict:
    return {
        "saved": sorted(plan.saved),
        "backward": list(plan.schedule.backward) if plan.ordered else None,
        "solver": plan.solver,
        "status": plan.status,
        "limit": plan.limit,
        "bound": plan.bound,
        "peak": plan.peak,
        "recompute_cost": plan.recompute_cost,
    }
