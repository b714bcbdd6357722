"""Status lines the launchers and tests read from a process's output (`... listening on HOST:PORT`)."""

import sys


def announce(line: str) -> None:
    """Writes `line` and its newline to stdout in one write, then flushes.

    With PYTHONUNBUFFERED set (containers and CI often set it), print() writes the text and the newline
    separately, and a log line from another thread, on stderr into the same pipe, can land between them:
    `scheduler listening on 127.0.0.1:34125` then became `...:341252026-11-23 ...`.
    """
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
