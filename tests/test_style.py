"""The code is formatted and linted by ruff ([tool.ruff] in pyproject.toml), and the check has teeth."""

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def ruff(*args: str, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(pathlib.Path(sys.executable).with_name("ruff")), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_code_is_formatted():
    result = ruff("format", "--check", ".")
    assert result.returncode == 0, "run `.venv/bin/ruff format .`:\n" + result.stdout + result.stderr


def test_the_lint_passes():
    result = ruff("check", ".")
    assert result.returncode == 0, "run `.venv/bin/ruff check --fix .`:\n" + result.stdout + result.stderr


def test_the_checks_catch_a_badly_formatted_unused_import(tmp_path):
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "bad.py").write_text("import os\nx = {  'a':1 }\n")
    assert ruff("format", "--check", ".", cwd=tmp_path).returncode != 0
    result = ruff("check", ".", cwd=tmp_path)
    assert result.returncode != 0 and "F401" in result.stdout


def test_the_commit_hook_refuses_a_long_subject(tmp_path):
    hook = ROOT / "scripts" / "hooks" / "commit-msg"
    message = tmp_path / "COMMIT_EDITMSG"
    message.write_text("worker: a step as named stages\n\n" + "a long body line " * 20 + "\n")
    assert subprocess.run([str(hook), str(message)], capture_output=True).returncode == 0
    message.write_text("x" * 73 + "\n")
    result = subprocess.run([str(hook), str(message)], capture_output=True, text=True)
    assert result.returncode == 1 and "73 characters" in result.stderr
