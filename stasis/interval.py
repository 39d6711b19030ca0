"""How often to checkpoint a job: Young/Daly's interval from its cost and its interruption rate.

A checkpoint every tau seconds costs the job C seconds each time (it stands frozen while CRIU
dumps it), and an interruption (preemption, node failure, requeue) every M seconds on average
loses the work since the last checkpoint. Daly's higher-order estimate of the tau that minimises
the two together ("A higher order estimate of the optimum checkpoint interval for restart
dumps", Future Generation Computer Systems 22, 2006, eq. 37):

    tau = sqrt(2 C M) * (1 + 1/3 sqrt(C / 2M) + 1/9 (C / 2M)) - C    when C < 2M
    tau = M                                                         otherwise

(Young's first-order sqrt(2 C M) is its leading term.) A site's floor and ceiling bound it:
never more often than the floor (each checkpoint takes the node's dump slot and store space),
never rarer than the ceiling. No interruption seen (a rate of zero, or no history) gives the
ceiling, not "never": a window without interruptions proves no rate of zero.

Pure functions only: the integrations (Slurm, Kubernetes, the control plane) measure C and M and
call `choose`; what it returns says why, for `stasis slurm intervals` and the like.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Choice:
    interval_s: float  # what to use
    cost_s: float  # C: seconds one checkpoint costs the job
    mtbi_s: float | None  # M: mean seconds between interruptions; None = none seen
    raw_s: float | None  # Daly's tau before the bounds; None when there is no rate
    bound: str  # "" (Daly's value holds), "floor" or "ceiling": which bound set interval_s

    def why(self) -> str:
        """One line: cost, rate, raw value, bound."""
        if self.mtbi_s is None:
            return (
                f"no interruption seen: the ceiling, {duration(self.interval_s)} "
                f"(checkpoint cost {duration(self.cost_s)})"
            )
        assert self.raw_s is not None
        text = (
            f"checkpoint cost {duration(self.cost_s)}, mean time between interruptions "
            f"{duration(self.mtbi_s)}: Young/Daly {duration(self.raw_s)}"
        )
        if self.bound:
            text += (
                f", raised to the floor {duration(self.interval_s)}"
                if self.bound == "floor"
                else f", lowered to the ceiling {duration(self.interval_s)}"
            )
        return text

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "why": self.why()}


def daly(cost_s: float, mtbi_s: float) -> float:
    """Daly's higher-order optimum interval (seconds of work between checkpoints)."""
    if cost_s < 0 or mtbi_s <= 0 or not math.isfinite(cost_s) or math.isnan(mtbi_s):
        raise ValueError(f"no interval for cost {cost_s} s and MTBI {mtbi_s} s")
    if math.isinf(mtbi_s):
        return math.inf
    if cost_s >= 2 * mtbi_s:
        return mtbi_s
    ratio = cost_s / (2 * mtbi_s)
    return math.sqrt(2 * cost_s * mtbi_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost_s


def young(cost_s: float, mtbi_s: float) -> float:
    """Young's first-order interval, sqrt(2 C M) (for comparison)."""
    return math.sqrt(2 * cost_s * mtbi_s)


def mtbi_s(rate_per_node_hour: float, nodes: int = 1) -> float | None:
    """A job of `nodes` nodes' mean seconds between interruptions, at `rate_per_node_hour`
    interruptions per node-hour (any node's interruption interrupts the job); None at 0."""
    if rate_per_node_hour <= 0:
        return None
    return 3600.0 / (rate_per_node_hour * max(1, nodes))


def choose(cost_s: float, mtbi: float | None, floor_s: float, ceiling_s: float) -> Choice:
    """The interval for a job whose checkpoint costs `cost_s` and whose mean time between
    interruptions is `mtbi` (None: none seen), within [floor_s, ceiling_s]. A floor above the
    ceiling wins (never more often than the floor)."""
    cost_s = max(0.0, cost_s)
    ceiling_s = max(floor_s, ceiling_s)
    if mtbi is None or math.isinf(mtbi):
        return Choice(interval_s=ceiling_s, cost_s=cost_s, mtbi_s=None, raw_s=None, bound="ceiling")
    raw = daly(cost_s, mtbi)
    if raw < floor_s:
        return Choice(floor_s, cost_s, mtbi, raw, "floor")
    if raw > ceiling_s:
        return Choice(ceiling_s, cost_s, mtbi, raw, "ceiling")
    return Choice(raw, cost_s, mtbi, raw, "")


def duration(seconds: float) -> str:
    """A duration as a person reads it: 4.20 s, 95 s, 12 min, 7.5 h."""
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 600:
        return f"{seconds:.0f} s"
    if seconds < 3 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
