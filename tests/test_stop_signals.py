"""SIGTERM and SIGINT reach the serving loop through StopSignals."""

import os
import signal
import threading
import time

import pytest

from specdec.stop_signals import StopSignals


@pytest.fixture
def restore_handlers():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    wakeup_fd = signal.set_wakeup_fd(-1)  # reads it (and sets it back below)
    signal.set_wakeup_fd(wakeup_fd)
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    signal.set_wakeup_fd(wakeup_fd)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_the_wait(restore_handlers, sig):
    signals = StopSignals()
    threading.Timer(0.2, os.kill, (os.getpid(), sig)).start()
    started = time.monotonic()
    signals.wait(threading.Event())  # never set: only the signal can end this
    assert signals.received == sig
    assert time.monotonic() - started < 10


def test_a_signal_before_the_wait_is_kept(restore_handlers):
    signals = StopSignals()
    os.kill(os.getpid(), signal.SIGTERM)  # while "loading the model"
    signals.wait(threading.Event())
    assert signals.received == signal.SIGTERM


def test_the_other_stop_ends_the_wait_too(restore_handlers):
    signals, stop = StopSignals(), threading.Event()
    threading.Timer(0.2, stop.set).start()
    signals.wait(stop)
    assert signals.received is None


def test_off_the_main_thread_no_handler_is_installed(restore_handlers):
    before = signal.getsignal(signal.SIGTERM)
    created = []
    thread = threading.Thread(target=lambda: created.append(StopSignals()))
    thread.start()
    thread.join()
    assert signal.getsignal(signal.SIGTERM) is before


def test_off_the_main_thread_the_other_stop_ends_the_wait(restore_handlers):
    stop, done = threading.Event(), threading.Event()

    def wait() -> None:
        StopSignals().wait(stop)
        done.set()

    thread = threading.Thread(target=wait)
    thread.start()
    assert not done.wait(0.3)  # it waits for the stop
    stop.set()
    thread.join(10)
    assert done.is_set()
