"""SIGTERM and SIGINT for the serving processes: a flag the handler sets without taking a lock.

A handler runs on the main thread between two bytecodes, wherever that thread is. A handler that called
`threading.Event.set()` could land while the main thread held that Event's own lock (inside its timed
`wait()`), and block on it forever: a worker in CI ignored a SIGTERM for 30 s and had to be killed. The
handler here only stores the signal number, and the main thread polls it with short sleeps (a sleep takes no
lock; a signal cuts it short, and it resumes for what is left of it).
"""

import signal
import threading
import time

POLL_S = 0.05  # how soon the main thread notices a signal (or the other stop): a drain starts at once


class StopSignals:
    """Installed on the main thread before the slow part of starting, so that an early signal is kept."""

    def __init__(self) -> None:
        self.received: int | None = None
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.received = signum  # a plain store: no lock, so it cannot wait on the interrupted thread

    def wait(self, stop: threading.Event) -> None:
        """Returns once a signal has arrived or `stop` is set (by another thread)."""
        while self.received is None and not stop.is_set():  # is_set() reads a flag: no lock either
            time.sleep(POLL_S)
