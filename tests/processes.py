"""Starting real specdec processes on 127.0.0.1 port 0 for tests."""

import contextlib
import os
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


def free_port() -> int:
    """A loopback port free now (for flags where 0 means off rather than any port)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` different loopback ports free now: each held until all are chosen (one at a time, the system may
    hand out the same port twice)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.create_server(("127.0.0.1", 0))) for _ in range(count)]
        return [sock.getsockname()[1] for sock in socks]
