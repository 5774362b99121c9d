"""Never more than eager (issue 25): the staged step, whole and unchunked, peaks at no more than 1.02x the
eager peak of the same step at the allocator, for every test model and for optimizers stepped inside it."""

from __future__ import annotations

import pytest
from eager_parity_cases import CASES, peaks


@pytest.mark.parametrize("name", list(CASES))
def test_the_staged_step_holds_no_more_than_eager(name):
    eager, staged = peaks(name)
    assert staged <= 1.02 * eager, f"{name}: staged {staged:,} B against eager {eager:,} B ({staged / eager:.3f}x)"
