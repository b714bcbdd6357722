"""The container image: the CPU build leaves Triton out, the documented GPU build puts it in, and the CPU
serving path works with Triton unimportable.

No Docker engine here: the Dockerfile's RUN lines run under /bin/sh with every command they call replaced by
a stub that logs its arguments, which gives the commands a build would run for given build args.
"""

import os
import pathlib
import re
import shlex
import subprocess
import sys
import tomllib

from specdec.v1 import generation_pb2 as pb
from tests.e2e.client import Server, greedy_request, stream
from tests.processes import running

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Every command the Dockerfile's RUN lines call; anything else fails the build transcript ("not found").
STUBBED_COMMANDS = ("apt-get", "rm", "pip", "groupadd", "useradd", "mkdir", "chown", "python")
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


def _instructions() -> list[tuple[str, str]]:
    """The Dockerfile's (INSTRUCTION, arguments), continuation lines joined, comments left out."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in joined.splitlines() if line.strip()]


def _documented_build_args(extras: str) -> dict[str, str]:
    """The --build-arg values of the header's `docker build` command whose EXTRAS is `extras` (or none)."""
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("#") and "docker build" in line:
            words = shlex.split(line.lstrip("# "))
            build_args = dict(words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "--build-arg")
            if build_args.get("EXTRAS", "") == extras:
                return build_args
    raise AssertionError(f"the Dockerfile's header documents no docker build with EXTRAS={extras!r}")


def _build_transcript(build_args: dict[str, str], tmp_path: pathlib.Path) -> list[list[str]]:
    """Every command the RUN lines would run (argv lists), with the ARG defaults overridden by build_args."""
    stubs, log = tmp_path / "bin", tmp_path / "commands.log"
    stubs.mkdir()
    for name in STUBBED_COMMANDS:
        stub = stubs / name
        stub.write_text(f'#!/bin/sh\nprintf \'%s\\037\' "${{0##*/}}" "$@" >> {log}\necho >> {log}\n')
        stub.chmod(0o755)
    env = {"PATH": str(stubs)}
    for instruction, arguments in _instructions():
        if instruction == "ARG":
            name, _, default = arguments.partition("=")
            env[name] = build_args.get(name, default)
        elif instruction == "RUN":
            result = subprocess.run(["/bin/sh", "-c", arguments], env=env, capture_output=True, text=True)
            assert result.returncode == 0, (arguments, result.stderr)
    assert not set(build_args) - set(env), "a build arg the Dockerfile does not declare"
    return [line.rstrip("\x1f").split("\x1f") for line in log.read_text().splitlines()] if log.exists() else []


def _installed_requirements(commands: list[list[str]]) -> list[str]:
    """What the pip installs ask for; `.` and `.[extras]` expand to the project's (extra) dependencies."""
    requirements = []
    for argv in commands:
        if argv[:2] != ["pip", "install"]:
            continue
        for target in (a for a in argv[2:] if not a.startswith("-") and not a.startswith("http")):
            match = re.fullmatch(r"\.(?:\[(.*)\])?", target)
            if not match:
                requirements.append(target)
                continue
            requirements += PYPROJECT["project"]["dependencies"]
            for extra in filter(None, (match.group(1) or "").split(",")):
                requirements += PYPROJECT["project"]["optional-dependencies"][extra]
    return requirements


def _pip_installs(commands: list[list[str]]) -> list[list[str]]:
    return [argv for argv in commands if argv[:2] == ["pip", "install"]]


def test_triton_is_an_extra_not_a_dependency():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert not any(r.startswith("triton") for r in PYPROJECT["project"]["dependencies"])
    assert any(r.startswith("triton==") for r in extras["gpu"])
    assert "specdec[gpu]" in extras["test"]  # the kernel tests run the Triton kernels (TRITON_INTERPRET=1)


def test_cpu_image_installs_cpu_torch_first_and_no_triton(tmp_path):
    commands = _build_transcript(_documented_build_args(""), tmp_path)
    pip_installs = _pip_installs(commands)
    # torch first, alone, from the CPU index: `pip install .` then finds the pin satisfied.
    assert pip_installs[0] == ["pip", "install", "torch==2.13.0", "--index-url", CPU_TORCH_INDEX]
    assert pip_installs[1] == ["pip", "install", "."]
    assert not any("triton" in r for r in _installed_requirements(commands))
    installs = [argv for argv in commands if argv[:2] == ["apt-get", "install"]]
    assert installs and "gcc" in installs[0]  # the worker builds its CPU attention kernel at first use
    assert ["python", "-m", "worker_service.runtime.default_model", "fetch"] in commands  # the model is baked in


def test_documented_gpu_image_installs_cuda_torch_triton_and_a_compiler(tmp_path):
    build_args = _documented_build_args("gpu")
    assert build_args["TORCH_INDEX_URL"] != CPU_TORCH_INDEX
    commands = _build_transcript(build_args, tmp_path)
    pip_installs = _pip_installs(commands)
    assert pip_installs[0][:3] == ["pip", "install", "torch==2.13.0"] and CPU_TORCH_INDEX not in pip_installs[0]
    assert pip_installs[1] == ["pip", "install", ".[gpu]"]
    assert any(r.startswith("triton==") for r in _installed_requirements(commands))
    installs = [argv for argv in commands if argv[:2] == ["apt-get", "install"]]
    assert installs and "gcc" in installs[0]  # Triton builds its launchers with it too


def test_k8s_readme_documents_the_same_gpu_build():
    build_args = " ".join(f"--build-arg {k}={v}" for k, v in _documented_build_args("gpu").items())
    assert f"docker build {build_args} " in (ROOT / "deploy" / "k8s" / "README.md").read_text()


def test_image_user_matches_the_manifests_uid():
    runs = " ".join(arguments for instruction, arguments in _instructions() if instruction == "RUN")
    assert "--uid 10001" in runs and "--gid 10001" in runs
    assert ("USER", "specdec") in _instructions()


def test_cpu_serving_path_works_without_triton(tiny_pair, tmp_path):
    """`specdec serve` (scheduler + a worker process) with Triton unimportable, as in the CPU image."""
    blocker = tmp_path / "no_triton"
    blocker.mkdir()
    # Imported at interpreter start by every process (the workers too): as if triton were not installed,
    # `import triton` raises ImportError and importlib.util.find_spec("triton") returns None.
    (blocker / "sitecustomize.py").write_text('import sys\nsys.modules["triton"] = None\n')
    env = {"PYTHONPATH": os.pathsep.join([str(blocker), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    probe = subprocess.run(
        [sys.executable, "-c", "import kernels._triton as k; print(k.HAS_TRITON)"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.stdout.strip() == "False", probe.stderr  # the blocker works
    args = [
        "serve",
        "--port",
        "0",
        "--model",
        str(tiny_pair.target_path),
        "--block-size",
        "4",
        "--num-threads",
        "1",
        "--proposer",
        "ngram",
        "--num-speculative-tokens",
        "3",
    ]
    with running(args, env) as process:
        server = Server(process)
        try:
            tokens, last = stream(server.stub, greedy_request([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], 12))
            info = server.wait_idle()
        finally:
            server.channel.close()
    assert len(tokens) == 12 and last.finish_reason == pb.FINISH_REASON_LENGTH
    assert info.counters.num_drafted_tokens > 0  # the proposer, scorer and rejection sampler ran
