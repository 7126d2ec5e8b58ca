"""``--shrink-examples N`` (``FuzzOptions.shrink_examples``): one count of the examples and
replays every stage of shrinking spends together, never a time, so the same seed and budget
report the same failure anywhere; the rerun line names the budget, and the report says when
it ran out."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardkit._run.report import render_failure
from shardkit._run.runner import fuzz
from shardkit.errors import UsageError

#: A planted bug whose failure Hypothesis first sees long (dozens of steps) and which
#: shrinks to 3: a budget shows in the length it reports.
TARGET = "shardkit._planted:CancelledSessionStillServes"
MINIMUM = 3


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_budget_for_shrinking_reports_the_failure_as_first_found(tmp_path: Path, seed: int) -> None:
    result = fuzz(TARGET, seed=seed, out=tmp_path, shrink_examples=0)
    assert result.failure is not None
    assert result.first_failure is not None
    assert len(result.failure.records) == result.first_failure[2] > MINIMUM
    assert result.minimized is None
    assert result.shrink_budget_spent
    text = render_failure(result)
    assert "(shrinking stopped when --shrink-examples ran out)" in text, text
    assert result.rerun_command.endswith(f"--seed {seed} --shrink-examples 0"), result.rerun_command


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_budget_bounds_all_the_shrinking_and_gives_the_same_failure_again(tmp_path: Path, seed: int) -> None:
    budget = 40
    first = fuzz(TARGET, seed=seed, out=tmp_path / "first", shrink_examples=budget)
    again = fuzz(TARGET, seed=seed, out=tmp_path / "again", shrink_examples=budget)
    assert first.failure is not None
    assert again.failure is not None
    assert [record.action for record in first.failure.records] == [record.action for record in again.failure.records]
    # Each stage may start one example past its share (the one that finds the share spent).
    assert first.shrink_work <= budget + 3, first.shrink_work
    unbounded = fuzz(TARGET, seed=seed, out=tmp_path / "unbounded")
    assert unbounded.failure is not None
    assert unbounded.shrink_work > budget + 3, "the budget must have cut something for this test to say anything"
    assert not unbounded.shrink_budget_spent
    assert "--shrink-examples" not in unbounded.rerun_command
    assert len(unbounded.failure.records) == MINIMUM


def test_a_budget_that_is_not_a_count_is_refused_by_name() -> None:
    with pytest.raises(UsageError, match=r"shrink_examples \(--shrink-examples\) must be an integer >= 0"):
        fuzz(TARGET, seed=1, shrink_examples=-1)
