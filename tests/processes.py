"""Starting real specdec processes on 127.0.0.1 port 0 for tests."""

import contextlib
import os
import random
import re
import socket
import subprocess
import sys
import threading

_LISTEN = re.compile(r"listening on (\S+):(\d+)")


class Process:
    """A specdec subcommand (or another program) in a child process; its output lines are collected."""

    def __init__(
        self,
        args: list[str],
        env: dict | None = None,
        start_new_session: bool = False,
        program: list[str] | None = None,
    ):
        """start_new_session: in its own session and process group, as a supervisor starts it; program: what
        to run with `args` (default: `python -m specdec`)."""
        program = program if program is not None else [sys.executable, "-m", "specdec"]
        self.proc = subprocess.Popen(
            [*program, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=start_new_session,
        )
        self.lines: list[str] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = 180.0) -> re.Match:
        """Waits for an output line matching `pattern`; fails with the output if the process died."""
        regex = re.compile(pattern)
        with self.cond:
            found = self.cond.wait_for(
                lambda: any(regex.search(line) for line in self.lines) or self.proc.poll() is not None, timeout=timeout
            )
            match = next((m for line in self.lines if (m := regex.search(line))), None)
        if match is None:
            raise AssertionError(
                f"no line matching {pattern!r} (found={found}, exit={self.proc.poll()}):\n"
                + "\n".join(self.lines[-40:])
            )
        return match

    def address(self, timeout: float = 180.0, who: str = "") -> str:
        """The address from the first `<who> listening on HOST:PORT` line."""
        match = self.wait_for(who + _LISTEN.pattern, timeout)
        return f"{match.group(1)}:{match.group(2)}"

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@contextlib.contextmanager
def running(args: list[str], env: dict | None = None):
    process = Process(args, env)
    try:
        yield process
    finally:
        process.stop()


# Ports for flags that take a fixed one come from below the system's ephemeral range, in a slice of their own
# per pytest-xdist worker: a port the kernel hands out (port 0, or the source port of an outgoing connection)
# could be taken between our choosing it and the server binding it, and did once in CI.
_FIXED_PORTS_LOW = 10_000
_FIXED_PORTS_PER_WORKER = 2_000


def free_port() -> int:
    """A loopback port free now (for flags where 0 means off rather than any port)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` different loopback ports free now, from this xdist worker's slice below the ephemeral range
    (each held until all are chosen, so no two are the same)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    low = _FIXED_PORTS_LOW + index * _FIXED_PORTS_PER_WORKER
    start = random.randrange(_FIXED_PORTS_PER_WORKER)
    with contextlib.ExitStack() as stack:
        ports = []
        for offset in range(_FIXED_PORTS_PER_WORKER):
            port = low + (start + offset) % _FIXED_PORTS_PER_WORKER
            try:
                stack.enter_context(socket.create_server(("127.0.0.1", port)))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"fewer than {count} free ports in {low}..{low + _FIXED_PORTS_PER_WORKER - 1}")
