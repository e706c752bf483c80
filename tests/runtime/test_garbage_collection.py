"""The collector setting of Titanax's commands (titanax/runtime/garbage_collection.py)."""

import gc
import weakref

from titanax.runtime.garbage_collection import YOUNG_COLLECTION_THRESHOLD, tune_garbage_collection


class _Node:
    """An object that can sit in a reference cycle and be watched through a weak reference."""

    def __init__(self):
        self.other = None


def _cycle() -> _Node:
    first, second = _Node(), _Node()
    first.other, second.other = second, first
    return first


def test_startup_objects_are_frozen_and_cycles_are_still_collected_without_being_asked():
    before = gc.get_threshold()
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)  # CPython's defaults (the test session tuned its own).
    try:
        tune_garbage_collection()
        assert gc.get_threshold() == (YOUNG_COLLECTION_THRESHOLD, 10, 10)
        assert gc.get_freeze_count() > 10_000  # The modules imported so far, at least.
        watched = weakref.ref(_cycle())
        assert watched() is not None  # Kept by its cycle until a collection runs.
        for _ in range(2 * YOUNG_COLLECTION_THRESHOLD):  # Cyclic garbage, never gc.collect().
            _cycle()
        assert watched() is None
    finally:
        gc.set_threshold(*before)
