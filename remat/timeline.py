"""A step's memory over time as the simulator predicts it, for its plan and for storing
everything, with the budget: what ``remat plan --timeline`` plots and writes as JSON.

The simulator (``solvers.simulate``) gives the bytes live while each op runs, counted
above what was resident before the step, so its maximum is the plan's predicted peak to
the byte.
"""

from __future__ import annotations

from dataclasses import dataclass

from remat.solvers import Plan


@dataclass(frozen=True)
class StepTimeline:
    """Bytes live while each op runs, in run order, under the plan (``predicted``) and
    under the store-all plan of the same problem (``store_all``); ``*_backward`` is the
    index of the first backward op of each; ``limit`` the budget in bytes."""

    name: str
    limit: int
    predicted: tuple[int, ...]
    predicted_backward: int
    store_all: tuple[int, ...]
    store_all_backward: int

    @classmethod
    def of(cls, name: str, limit: int, plan: Plan, store_all: Plan) -> StepTimeline:
        return cls(
            name,
            limit,
            _live(plan),
            _backward_start(plan),
            _live(store_all),
            _backward_start(store_all),
        )

    @property
    def predicted_peak(self) -> int:
        return max(self.predicted, default=0)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "limit_bytes": self.limit,
            "predicted": {
                "bytes": list(self.predicted),
                "backward_starts_at": self.predicted_backward,
                "peak_bytes": self.predicted_peak,
            },
            "store_all": {
                "bytes": list(self.store_all),
                "backward_starts_at": self.store_all_backward,
                "peak_bytes": max(self.store_all, default=0),
            },
        }


def _live(plan: Plan) -> tuple[int, ...]:
    return tuple(live for _, _, live in plan.timeline.steps)


def _backward_start(plan: Plan) -> int:
    return sum(1 for phase, _, _ in plan.timeline.steps if phase == "fwd")
