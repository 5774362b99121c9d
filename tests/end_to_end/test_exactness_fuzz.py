"""Fixed-seed slices of the step fuzzers, sized for CI (under a minute of CPU together).

- tests/support/step_fuzz.py: random training steps whose loss reads a batch-sized weight or mask from an
  argument, a global, a closure, a module attribute, a buffer, a factory or Python data, trained under jit
  (whole, >= 3 uneven chunks, recomputing) and lazy with a budget, each equal to eager at float64 or refused by
  a named stagetorch error that left the model untouched.
- tests/support/step_fuzz_families.py (issue 43): one step of each op family (captured gather sources and
  indices, masks of every dtype and origin, in-place writes, picks, repeat/expand, batch statistics, reshapes,
  embeddings, einsum, scatter, losses, count-normalised losses, issue 43's leftovers), trained 3 optimizer
  steps under jit in >= 2 chunks and lazy with a budget against eager: never a raw error or a silent mismatch.

The long searches are tools/probes/fuzz_exactness.py and tools/probes/fuzz_families.py; every failure either
finds becomes a named case (tests/interpreters/test_captured_batch.py, tests/end_to_end/test_fuzz_regressions.py).
"""

from __future__ import annotations

import pytest
import step_fuzz
import step_fuzz_families

EXAMPLES = 8  # hypothesis's first 8 draws (the whole file: 39 s of CPU, `time pytest`, on a loaded 2-core machine)
FAMILY_SEED = 4300  # one case of each family: draw(FAMILY_SEED + i, family)


def test_random_steps_reading_batch_sized_tensors_equal_eager_or_are_refused_by_name(request):
    outcomes = step_fuzz.search(EXAMPLES, derandomize=True)
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        print("\n" + step_fuzz.summary(outcomes))
    failures = [o.report() for o in outcomes if o.failures]
    assert len(outcomes) == EXAMPLES
    assert not failures, f"{len(failures)} of {len(outcomes)} steps failed:\n\n" + "\n\n".join(failures)


@pytest.mark.parametrize("family", step_fuzz_families.FAMILIES)
def test_a_random_step_of_each_op_family_equals_eager_or_is_refused_by_name(family):
    i = step_fuzz_families.FAMILIES.index(family)
    outcome = step_fuzz_families.check(step_fuzz_families.draw(FAMILY_SEED + i, family))
    assert not outcome.failures, outcome.report()
    assert not outcome.results["jit"].memory, outcome.report()  # memory() costs every step jit runs
    for r in outcome.results.values():
        assert r.status != "refused" and (not r.status.startswith("refused") or "What to do" in r.detail), outcome.report()
