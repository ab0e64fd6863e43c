import threading

import pytest
import torch
from polls import eventually_sync

from scd_serve.engine.sink import LayerSink
from scd_serve.errors import TransferCorrupt, TransferFailed


def make(writes):
    return LayerSink(lambda layer, k, v: writes.append(layer), request_id="r", num_layers=2, num_tokens=3,
                     kv_heads=1, head_dim=4)


def test_checks_layer_and_shapes_before_writing():
    writes = []
    sink = make(writes)
    good = torch.zeros(3, 1, 4)
    for layer, k, v in [(2, good, good), (-1, good, good), (0.0, good, good), (0, torch.zeros(4, 1, 4), good),
                        (1, good, torch.zeros(3, 2, 4))]:
        with pytest.raises(TransferCorrupt):
            sink.write_layer(layer, k, v)
    assert writes == [] and not sink.complete
    sink.write_layer(torch.tensor(0), good, good)
    sink.write_layer(1, good, good)
    assert writes == [0, 1] and sink.complete


def test_close_waits_for_a_write_in_flight_and_refuses_later_ones():
    entered, release = threading.Event(), threading.Event()
    order = []

    def slow_write(layer, k, v):
        entered.set()
        release.wait(5)
        order.append("write")

    sink = LayerSink(slow_write, request_id="r", num_layers=1, num_tokens=1, kv_heads=1, head_dim=1)
    t = threading.Thread(target=sink.write_layer, args=(0, torch.zeros(1, 1, 1), torch.zeros(1, 1, 1)))
    t.start()
    assert entered.wait(5)
    waiting = threading.Event()  # close() reached the sink's lock (the write holds it)

    class Watched:  # the same lock; entering it from close() says so first
        def __init__(self, lock):
            self._lock = lock

        def __enter__(self):
            waiting.set()
            return self._lock.__enter__()

        def __exit__(self, *exc):
            return self._lock.__exit__(*exc)

    sink._lock = Watched(sink._lock)  # the write in flight entered the real lock before this
    closer = threading.Thread(target=lambda: (sink.close(), order.append("closed")))
    closer.start()
    # close() is blocked on the lock, or (wrongly) already done: either way the write is still in
    # flight, so a close() that does not wait for it shows up in `order` on any machine
    assert eventually_sync(lambda: waiting.is_set() or not closer.is_alive(), 5)
    release.set()
    t.join(5)
    closer.join(5)
    assert order == ["write", "closed"]  # blocks are freed only after the write finished
    with pytest.raises(TransferFailed):
        sink.write_layer(0, torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))


def test_prepare_runs_the_setup_under_the_lock_and_not_once_closed():
    calls = []
    sink = LayerSink(lambda *a: None, request_id="r", num_layers=1, num_tokens=1, kv_heads=1, head_dim=1,
                     prepare=lambda: calls.append(sink._lock.locked()))
    sink.prepare()
    assert calls == [True]  # serialized with writes and close()
    sink.close()
    sink.prepare()
    assert calls == [True]
    LayerSink(lambda *a: None, request_id="r", num_layers=1, num_tokens=1, kv_heads=1, head_dim=1).prepare()


def test_on_complete_fires_once_in_the_writing_thread_after_the_last_layer():
    fired = []
    sink = LayerSink(lambda *a: None, request_id="r", num_layers=2, num_tokens=3, kv_heads=1, head_dim=4,
                     on_complete=lambda: fired.append((threading.current_thread().name, sink._lock.locked())))
    good = torch.zeros(3, 1, 4)
    sink.write_layer(1, good, good)
    assert fired == []
    writer = threading.Thread(target=sink.write_layer, args=(0, good, good), name="writer")
    writer.start()
    writer.join(5)
    assert fired == [("writer", False)]  # outside the lock: the callback may take its time
    sink.write_layer(0, good, good)  # a rewrite (a retry) does not fire it again
    assert fired == [("writer", False)]


def test_on_complete_never_fires_for_a_closed_sink():
    fired = []
    sink = LayerSink(lambda *a: None, request_id="r", num_layers=1, num_tokens=1, kv_heads=1, head_dim=1,
                     on_complete=lambda: fired.append(1))
    sink.close()
    with pytest.raises(TransferFailed):
        sink.write_layer(0, torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))
    assert fired == []


def test_a_limited_fill_takes_the_shorter_rows_and_tells_its_writer_once():
    writes, told = [], []
    sink = LayerSink(lambda layer, k, v: writes.append((layer, k.shape[0])), request_id="r", num_layers=2,
                     num_tokens=5, kv_heads=1, head_dim=4, on_limit=told.append)
    sink.write_layer(0, torch.zeros(5, 1, 4), torch.zeros(5, 1, 4))  # an attempt at the whole handoff
    sink.limit(3)
    sink.limit(3)  # a retry of the same length changes nothing
    assert told == [3] and sink.num_tokens == 3 and not sink.complete  # the old attempt's layer does not count
    with pytest.raises(TransferCorrupt):
        sink.write_layer(0, torch.zeros(5, 1, 4), torch.zeros(5, 1, 4))
    sink.write_layer(0, torch.zeros(3, 1, 4), torch.zeros(3, 1, 4))
    sink.write_layer(1, torch.zeros(3, 1, 4), torch.zeros(3, 1, 4))
    assert sink.complete and writes == [(0, 5), (0, 3), (1, 3)]
    for bad in (0, 6):
        with pytest.raises(TransferFailed):
            sink.limit(bad)


def test_a_last_row_is_checked_and_taken_only_for_the_whole_handoff():
    rows = []
    sink = LayerSink(lambda layer, k, v: None, request_id="r", num_layers=2, num_tokens=3, kv_heads=1, head_dim=4,
                     write_last=lambda layer, k, v, h: rows.append((layer, h is not None)))
    row = torch.zeros(1, 1, 4)
    for layer, k, v, h in [(2, row, row, None), (0, torch.zeros(2, 1, 4), row, None), (0, row, None, None),
                           (1, row, row, torch.zeros(2, 8)), (1, row, row, torch.zeros(8))]:
        with pytest.raises(TransferCorrupt):
            sink.write_last_row(layer, k, v, h)
    assert sink.takes_last_row and rows == []
    sink.write_last_row(0, row, row)
    sink.write_last_row(1, row, row, torch.zeros(1, 8))
    assert rows == [(0, False), (1, True)]
    sink.limit(2)  # a replayed tail: the engine prefills the rest, the last row is not the next slot
    assert not sink.takes_last_row
    sink.write_last_row(0, row, row)
    assert len(rows) == 2
    sink.close()
    with pytest.raises(TransferFailed):
        sink.write_last_row(0, row, row)
    plain = make([])  # an engine that cannot take one: ignored
    assert not plain.takes_last_row
    plain.write_last_row(0, torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
