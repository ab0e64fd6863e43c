"""`scd-serve up`'s own plumbing: its stop signal, its reading of a worker's one-line error."""

import subprocess
import sys
import threading

import pytest

from scd_serve.cluster import up

pytestmark = pytest.mark.timeout(60)


def test_a_stop_signal_while_the_main_thread_holds_the_event_lock_still_stops():
    # the main thread spends its life in _stop.wait(); a handler that set the event itself would
    # wait for the lock the interrupted wait holds, forever
    up._stop.clear()
    try:
        with up._stop._cond:  # what the main thread holds inside Event.wait when the signal lands
            up._on_signal()
        assert up._stop.wait(10)
    finally:
        up._stop.clear()


def test_a_worker_that_exits_2_is_reported_by_its_own_line(monkeypatch):
    code = ("import sys; print('starting'); print('scd-serve decode: error: port 1 is in use', file=sys.stderr); "
            "sys.exit(2)")
    monkeypatch.setattr(up.Child, "start", lambda self: _start(self, code))
    child = up.Child("decode-0", [], {})
    child.proc.wait(30)
    err = child.exited()
    assert type(err).__name__ == "ConfigError" and err.message == "decode-0: port 1 is in use"
    assert list(child.lines) == ["starting"]  # the error line is up's to print, once


def _start(child, code):
    child.error = None
    child.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
    child._reader = threading.Thread(target=child._echo, args=(child.proc,), daemon=True)
    child._reader.start()
