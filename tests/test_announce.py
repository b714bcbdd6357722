"""Status lines (`... listening on HOST:PORT`) reach stdout in one write, so no other line can split them."""

import sys

from specdec.announce import announce


class _Recorder:
    def __init__(self):
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        self.writes.append("<flush>")


def test_announce_writes_the_line_and_its_newline_at_once(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(sys, "stdout", recorder)
    announce("scheduler listening on 127.0.0.1:34125")
    assert recorder.writes == ["scheduler listening on 127.0.0.1:34125\n", "<flush>"]
