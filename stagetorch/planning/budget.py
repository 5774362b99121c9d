"""The budget arithmetic every strategy plans with: the safety margin, the usable bytes of a budget, the
smallest budget that leaves a peak usable, the 0.4% buckets plans are kept by, and what the program is
left of a call's budget beside what the call holds.

One home for these numbers, so that the chunk planner, the joint planner, the cut, the passes and the
stateful :class:`~stagetorch.planning.planner.Planner` (and the lazy mode's keys) agree to the byte. It knows
integers only: no graph, plan or device.
"""

from __future__ import annotations

__all__ = [
    "SAFETY_MARGIN", "usable", "fits", "covering", "smallest_budget", "budget_below", "margin_words", "bucket",
    "beside",
]

# Fraction of the budget the plan leaves unused: the allocator's rounding and fragmentation live there.
SAFETY_MARGIN = 0.10


def usable(budget: int) -> int:
    """The bytes of ``budget`` a plan may fill: the budget less the safety margin, rounded down."""
    return int(budget * (1 - SAFETY_MARGIN))


def fits(peak: int, budget: int) -> bool:
    """Whether ``peak`` bytes run within ``budget`` with its margin kept."""
    return peak <= budget * (1 - SAFETY_MARGIN)


def covering(nbytes: int) -> int:
    """The budget whose usable part is ``nbytes`` (rounded down): what a plan holding ``nbytes`` takes of one."""
    return int(nbytes / (1 - SAFETY_MARGIN))


def smallest_budget(needs: int) -> int:
    """The smallest budget (to a byte) whose usable part holds ``needs`` bytes, as an error names it."""
    return covering(needs) + 1


def budget_below(peak: int) -> int:
    """A budget whose usable part ends a byte below ``peak``: the largest that plans below a failed peak."""
    return covering(peak) - 1


def margin_words() -> str:
    """The margin as an error says it ("10%")."""
    return f"{SAFETY_MARGIN:.0%}"


def bucket(budget: int) -> int:
    """``budget`` to about 0.4% (its top 9 bits): plans are kept per bucket, as the free memory moves a
    little between calls and a plan made for a budget up to 0.4% larger is within this one's margin."""
    shift = max(budget.bit_length() - 9, 0)
    return budget >> shift << shift


def beside(budget: int, held: int, calibration: int | None = None) -> int:
    """What the program is left of a call's ``budget``: less the ``held`` bytes the call holds beside it and
    the ``calibration`` a CUDA run measured beyond its plans; may be negative (the caller bounds it)."""
    return budget - held - (calibration or 0)
