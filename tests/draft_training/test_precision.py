"""Training precision (recipe.PRECISIONS): bf16 autocast runs the head's matmuls in bf16 and keeps its weights,
gradients and loss in fp32; fp32 runs everything in fp32; auto follows the device's native bf16 support."""

from types import SimpleNamespace

import pytest
import torch

from draft_training import trainer as trainer_module
from draft_training.head import TrainableHead, head_config
from draft_training.recipe import TrainConfig
from draft_training.trainer import Trainer, autocast_dtype
from tests.draft_training.test_teacher import NUM_STEPS, conversations
from worker_service.runtime.eagle3_head import default_aux_layers
from worker_service.runtime.loader import load_model


def new_trainer(tiny_pair, tmp_path, precision: str) -> tuple[Trainer, list]:
    model = load_model(tiny_pair.target_path)
    config = SimpleNamespace(
        learning_rate=1e-3, num_steps=NUM_STEPS, seed=0, epochs=1, checkpoint_every=100, precision=precision
    )
    torch.manual_seed(0)
    head = TrainableHead(
        head_config(model.config, 200, default_aux_layers(model.config.num_hidden_layers)),
        model.model.embed_tokens.weight,
        model.lm_head.weight,
        model.model.norm.weight,
        torch.arange(3, 203),
    )
    return Trainer(head, config, tmp_path / "checkpoint.pt"), conversations(model)


@pytest.mark.parametrize("precision, matmul_dtype", [("bfloat16", torch.bfloat16), ("float32", torch.float32)])
def test_a_training_step_runs_the_heads_matmuls_in_the_chosen_precision(tiny_pair, tmp_path, precision, matmul_dtype):
    trainer, batch = new_trainer(tiny_pair, tmp_path, precision)
    seen = []
    hook = trainer.head.lm_head.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    before = {name: p.detach().clone() for name, p in trainer.head.named_parameters() if p.requires_grad}
    loss, _ = trainer._train_step(batch)
    hook.remove()
    assert seen and set(seen) == {matmul_dtype}  # every unrolled step's output layer
    assert loss > 0
    for name, parameter in trainer.head.named_parameters():
        if parameter.requires_grad:  # the master weights and their gradients stay fp32, and they moved
            assert parameter.dtype == torch.float32 and parameter.grad.dtype == torch.float32, name
    assert any(not torch.equal(before[n], p) for n, p in trainer.head.named_parameters() if n in before)


def test_bf16_and_fp32_losses_agree_to_bf16_rounding(tiny_pair, tmp_path):
    fp32, batch = new_trainer(tiny_pair, tmp_path, "float32")
    bf16, _ = new_trainer(tiny_pair, tmp_path, "bfloat16")
    with torch.no_grad():
        fp32_loss, _ = fp32._losses(batch)
        bf16_loss, _ = bf16._losses(batch)
    assert bf16_loss.dtype == torch.float32
    torch.testing.assert_close(bf16_loss, fp32_loss, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("native", [True, False])
def test_auto_uses_bf16_only_where_the_device_has_it(monkeypatch, native):
    monkeypatch.setattr(trainer_module, "has_native_bf16", lambda device: native)
    cpu = torch.device("cpu")
    assert autocast_dtype("auto", cpu) == (torch.bfloat16 if native else None)
    assert autocast_dtype("bfloat16", cpu) == torch.bfloat16 and autocast_dtype("float32", cpu) is None


def test_an_unknown_precision_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="unknown precision 'fp8'; choose from auto, float32, bfloat16"):
        TrainConfig(model="", output="", work_dir="", precision="fp8")
