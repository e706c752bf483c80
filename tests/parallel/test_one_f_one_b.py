"""The 1F1B schedule table: every microbatch forward then backward once per stage, dependencies
respected, buffer slots never overwritten while needed, memory flat in M."""

import numpy as np
import pytest

from titanax.parallel.one_f_one_b import BACKWARD, FORWARD, build_schedule


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
@pytest.mark.parametrize("factor", [1, 2, 4])
def test_schedule_invariants(stages, factor):
    count = stages * factor + (1 if factor == 2 else 0)
    table = build_schedule(stages, count)
    done = {}
    for tick in range(table.num_ticks):
        for stage in range(stages):
            kind, m = int(table.kind[tick, stage]), int(table.microbatch[tick, stage])
            if kind == FORWARD:
                assert stage == 0 or done.get(("F", stage - 1, m), tick) < tick
                done[("F", stage, m)] = tick
            elif kind == BACKWARD:
                assert done.get(("F", stage, m), tick) < tick
                assert stage == stages - 1 or done.get(("B", stage + 1, m), tick) < tick
                done[("B", stage, m)] = tick
    for stage in range(stages):
        forwards = sorted((done[("F", stage, m)], m) for m in range(count))
        backwards = sorted((done[("B", stage, m)], m) for m in range(count))
        assert [m for _, m in forwards] == list(range(count))   # Each once, in order.
        assert [m for _, m in backwards] == list(range(count))
        # Slot m % S holds microbatch m's input from its arrival until its backward: the next
        # user of the slot (m + S) must arrive after that backward.
        for m in range(count - stages):
            arrival = done[("F", stage - 1, m + stages)] if stage else done[("F", 0, m + stages)]
            assert arrival >= done[("B", stage, m)], (stage, m)
    assert all(peak <= stages - s for s, peak in enumerate(table.max_in_flight()))
    assert table.num_ticks == 2 * (count + stages - 1)


def test_memory_is_flat_in_the_number_of_microbatches():
    assert build_schedule(4, 8).max_in_flight() == build_schedule(4, 64).max_in_flight()
    assert np.isclose(build_schedule(4, 8).bubble(), 3 / 11)
