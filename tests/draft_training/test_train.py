"""`specdec train-draft` end to end on the tiny target: the target's own responses and features, a head the
worker loads that beats a random head, a run that resumes from its checkpoint exactly, and one-line errors."""

import json
import pathlib
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file
import torch

from draft_training import dataset
from draft_training.recipe import TrainConfig
from draft_training.train import run
from draft_training.trainer import Trainer, autocast_dtype
from specdec.cli import build_parser
from tests.tiny_models import save_tiny_eagle3_head
from tests.worker.driver import Driver
from tests.worker.speculation.test_eagle3 import BLOCK_SIZE, NUM_BLOCKS, make_worker
from worker_service.runtime.runner import SequenceChunk

PROMPT_WORDS = [[10, 11, 12, 13, 14], [20, 21, 22], [30, 31, 30, 31, 30], [40, 41, 42, 43], [50, 60, 70, 80]]


def prompts_file(tmp_path):
    path = tmp_path / "prompts.txt"
    lines = [" ".join(f"w{w + i}" for w in words) for i in range(4) for words in PROMPT_WORDS]
    path.write_text("\n".join(lines) + "\n")
    return path


def config(tiny_pair, tmp_path, name, **kwargs) -> TrainConfig:
    settings = dict(
        model=str(tiny_pair.target_path),
        output=str(tmp_path / name),
        work_dir=str(tmp_path / f"{name}-work"),
        sources=("self",),
        prompt_files=(str(prompts_file(tmp_path)),),
        num_self_prompts=8,
        max_new_tokens=24,
        generation_batch_size=8,
        dtype="float32",
        device="cpu",
        epochs=30,
        eval_fraction=0.2,
        batch_tokens=256,
        checkpoint_every=4,
        num_steps=3,
        learning_rate=3e-3,
        num_threads=1,
    )
    return TrainConfig(**{**settings, **kwargs})


def acceptance(tiny_pair, head_dir) -> float:
    worker = make_worker(tiny_pair, head_dir, k=3)
    driver = Driver(worker.execute, BLOCK_SIZE, NUM_BLOCKS)
    driver.generate([[3, *words, 4, 5] for words in PROMPT_WORDS], 20, num_speculative_tokens=3)  # chat-templated
    outputs = [o for r in driver.results for o in r.outputs]
    return sum(o.num_accepted_tokens for o in outputs) / max(sum(o.num_draft_tokens for o in outputs), 1)


@pytest.fixture(scope="module")
def trained(tiny_pair, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("train")
    return config(tiny_pair, tmp_path, "head"), run(config(tiny_pair, tmp_path, "head"))


def test_a_trained_head_loads_and_beats_a_random_head(tiny_pair, trained, tmp_path):
    cfg, summary = trained
    assert summary["num_conversations"] > 20 and summary["sources"]["self"]["num_prompts"] > 0
    assert len(summary["held_out_accuracy_by_position"]) == 3
    expected_precision = "bfloat16" if autocast_dtype("auto", torch.device("cpu")) else "float32"
    assert summary["train_precision"] == expected_precision
    assert f"training precision {expected_precision}" in (pathlib.Path(cfg.output) / "README.md").read_text()
    card = pathlib.Path(cfg.output) / "README.md"
    assert "| self | the target's own output |" in card.read_text() and "Held-out accuracy" in card.read_text()
    assert "CUDA" not in summary["machine"] and f"- Machine: {summary['machine']}," in card.read_text()
    random_head = save_tiny_eagle3_head(tmp_path / "random", draft_vocab_size=summary["draft_vocab_size"])
    trained_rate, random_rate = acceptance(tiny_pair, cfg.output), acceptance(tiny_pair, random_head)
    assert trained_rate > random_rate + 0.1, (trained_rate, random_rate)


def test_a_head_trained_on_soft_labels_beats_a_random_head(tiny_pair, trained, tmp_path):
    """--soft-labels: the same shards, the target's distribution as labels (its tail over the stored features).
    In fp32 (the other runs take the default precision, bf16 where the CPU has it): both precisions train."""
    cfg, hard = trained
    soft = config(tiny_pair, tmp_path, "soft", soft_labels=True, precision="float32")
    shutil.copytree(cfg.work_dir, soft.work_dir, ignore=shutil.ignore_patterns("checkpoint.pt"))
    summary = run(soft)
    assert summary["num_train_tokens"] == hard["num_train_tokens"]
    assert summary["train_precision"] == "float32"
    assert (
        "the target's distribution over the draft vocabulary" in (pathlib.Path(soft.output) / "README.md").read_text()
    )
    random_head = save_tiny_eagle3_head(tmp_path / "random", draft_vocab_size=summary["draft_vocab_size"])
    soft_rate, random_rate = acceptance(tiny_pair, soft.output), acceptance(tiny_pair, random_head)
    assert soft_rate > random_rate + 0.1, (soft_rate, random_rate)


@pytest.mark.gpu
def test_a_head_trained_on_cuda_saves_and_loads(tiny_pair, tmp_path):
    """The whole recipe on CUDA: the head trains there and is written with its vocabulary maps on the host."""
    cfg = config(tiny_pair, tmp_path, "cuda-head", device="cuda", epochs=2)
    summary = run(cfg)
    assert len(summary["held_out_accuracy_by_position"]) == 3
    assert torch.cuda.get_device_name() in (pathlib.Path(cfg.output) / "README.md").read_text()  # the card's machine
    assert acceptance(tiny_pair, cfg.output) >= 0.0  # the worker (on the CPU) loads and drafts with it


def test_the_features_are_the_served_targets(tiny_pair, trained):
    """A conversation's stored features equal the target runner's auxiliary states over the same tokens."""
    cfg, _ = trained
    conversation = dataset.load_shards(sorted(pathlib.Path(cfg.work_dir).glob("shard-*.pt")))[0]
    worker = make_worker(tiny_pair)
    worker.target.aux_layers = (2, 2, 1)
    tokens = conversation.token_ids[:-1]
    worker.target.forward([SequenceChunk(tokens, 0, list(range(-(-len(tokens) // BLOCK_SIZE))))])
    torch.testing.assert_close(
        conversation.aux_hidden.float(), worker.target.last_aux_hidden, rtol=2e-2, atol=2e-2
    )  # stored in bf16


def test_an_interrupted_run_resumes_to_the_same_head(tiny_pair, trained, tmp_path, monkeypatch):
    cfg, _ = trained
    resumed = config(tiny_pair, tmp_path, "resumed")
    shutil.copytree(cfg.work_dir, resumed.work_dir, ignore=shutil.ignore_patterns("checkpoint.pt"))
    earlier = {"prompts_min": 5.0, "responses_min": 7.0, "train_min": 0.0}  # as if the stages had taken that long
    (pathlib.Path(resumed.work_dir) / "minutes.json").write_text(json.dumps(earlier))
    real_step, calls = Trainer._train_step, []

    def interrupted(self, batch):
        calls.append(1)
        if len(calls) > 6:
            raise KeyboardInterrupt
        return real_step(self, batch)

    monkeypatch.setattr(Trainer, "_train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(resumed)
    after_interruption = json.loads((pathlib.Path(resumed.work_dir) / "minutes.json").read_text())
    assert after_interruption["train_min"] > 0  # the steps up to the checkpoint count
    monkeypatch.setattr(Trainer, "_train_step", real_step)
    summary = run(resumed)  # from the checkpoint of step 4: steps 5.. only
    # The card's minutes are the whole work's, the stages done before the resumed run included.
    assert summary["minutes"]["prompts_min"] >= 5.0 and summary["minutes"]["responses_min"] >= 7.0
    assert summary["minutes"]["train_min"] >= round(after_interruption["train_min"], 1)
    expected, got = load_file(f"{cfg.output}/model.safetensors"), load_file(f"{resumed.output}/model.safetensors")
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specdec", "train-draft", *args], capture_output=True, text=True, timeout=120
    )


def run_in_process(capsys, *args) -> subprocess.CompletedProcess:
    """`specdec train-draft ARGS`'s handler, in this process (the same parser and handler; `main`'s logging
    setup and the interpreter's exit are the subprocess case's subject)."""
    parsed = build_parser().parse_args(["train-draft", *args])
    code = parsed.func(parsed)
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


# One case as a real `python -m specdec` process: the exit status and stderr a user sees; the others run the
# same handler in this process (a process start imports torch, ~6 s).
@pytest.mark.parametrize("case, in_process", [("unreadable", True), ("empty", True), ("no-target", False)])
def test_bad_input_fails_with_one_clear_line(tiny_pair, tmp_path, capsys, case, in_process):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    args = {
        "unreadable": ["--model", str(tiny_pair.target_path), "--prompts", str(tmp_path / "missing.txt")],
        "empty": ["--model", str(tiny_pair.target_path), "--sources", "none", "--prompts", str(empty)],
        "no-target": ["--model", str(tmp_path / "no-model")],
    }[case]
    args += ["--output", str(tmp_path / "out"), "--device", "cpu"]
    result = run_in_process(capsys, *args) if in_process else run_cli(*args)
    expected = {
        "unreadable": "cannot read prompts from",
        "empty": "no prompts in it",
        "no-target": "not a checkpoint directory",
    }[case]
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("specdec train-draft: error:")]
    assert len(errors) == 1 and expected in errors[0]
