"""A fixed-seed slice of the step fuzzer (tests/support/step_fuzz.py): random training steps whose loss reads a
batch-sized weight or mask from an argument, a global, a closure, a module attribute, a buffer, a factory or
Python data, trained under jit (whole, >= 3 uneven chunks, recomputing) and lazy with a budget, each equal to
eager at float64 or refused by a named stagetorch error that left the model untouched. The long search is
tools/probes/fuzz_exactness.py; every failure either finds becomes a named case in tests/interpreters/test_captured_batch.py.
"""

from __future__ import annotations

import step_fuzz

EXAMPLES = 30  # 85 s of CPU (6 min on a machine 2 cores shared 8 ways)


def test_random_steps_reading_batch_sized_tensors_equal_eager_or_are_refused_by_name(request):
    outcomes = step_fuzz.search(EXAMPLES, derandomize=True)
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        print("\n" + step_fuzz.summary(outcomes))
    failures = [o.report() for o in outcomes if o.failures]
    assert len(outcomes) == EXAMPLES
    assert not failures, f"{len(failures)} of {len(outcomes)} steps failed:\n\n" + "\n\n".join(failures)
