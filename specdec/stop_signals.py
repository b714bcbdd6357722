"""SIGTERM and SIGINT for the serving processes: a flag the handler sets without taking a lock.

A handler runs on the main thread between two bytecodes, wherever that thread is. A handler that called
`threading.Event.set()` could land while the main thread held that Event's own lock (inside its timed
`wait()`), and block on it forever: a worker in CI ignored a SIGTERM for 30 s and had to be killed. The
handler here only stores the signal number. The main thread waits in `select` on a pipe that the signal's
C-level handler writes to (`signal.set_wakeup_fd`), which takes no lock and returns as soon as a signal
comes; it looks at the other stop (an Event another thread sets) every STOP_POLL_S. An idle server's main
thread so wakes 4 times a second, not 20 (it slept POLL_S = 0.05 s at a time before).
"""

import contextlib
import os
import select
import signal
import threading

STOP_POLL_S = 0.25  # how soon the main thread notices the other stop (a signal: at once)


class StopSignals:
    """Installed on the main thread before the slow part of starting, so that an early signal is kept."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._wakeup_fd: int | None = None  # the read end of the pipe signals write to (main thread only)
        if threading.current_thread() is threading.main_thread():
            read_fd, write_fd = os.pipe()
            os.set_blocking(read_fd, False)
            os.set_blocking(write_fd, False)
            signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
            self._wakeup_fd = read_fd
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.received = signum  # a plain store: no lock, so it cannot wait on the interrupted thread

    def wait(self, stop: threading.Event) -> None:
        """Returns once a signal has arrived or `stop` is set (by another thread)."""
        if self._wakeup_fd is None:  # off the main thread: no handler here, so nothing interrupts Event.wait
            stop.wait()
            return
        while self.received is None and not stop.is_set():  # is_set() reads a flag: no lock either
            select.select([self._wakeup_fd], [], [], STOP_POLL_S)
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wakeup_fd, 512):  # what signals wrote; the handler has run by now
                    pass
