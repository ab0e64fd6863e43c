"""freeze_heap: what a serving process made at start-up is kept out of later collections."""

import gc
import weakref

from scd_serve.control.lifecycle import freeze_heap


class Node:
    def __init__(self):
        self.self_ref = self  # a cycle: only the collector can free it


def test_start_up_objects_leave_the_collections_and_garbage_made_before_is_gone():
    before = gc.get_freeze_count()
    kept = [Node() for _ in range(1000)]
    garbage = Node()
    gone = weakref.ref(garbage)
    del garbage
    try:
        freeze_heap()
        assert gc.get_freeze_count() >= before + len(kept)
        assert not any(isinstance(x, Node) for x in gc.get_objects())  # the kept nodes: frozen, not tracked
        assert gone() is None  # the cycle made before was collected first, not frozen for good
    finally:
        gc.unfreeze()
