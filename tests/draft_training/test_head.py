"""The training head computes what the serving head computes, step by step (the unrolled "training-time
test" equals catch-up then drafting on the paged KV), and saves what the worker loads."""

import torch

from draft_training.head import TrainableHead, head_config
from kernels.quantized import QBLOCK, BlockWeight
from tests.worker.speculation.test_eagle3 import facts
from worker_service.runtime.eagle3_head import HEAD_WEIGHT_FORMAT, default_aux_layers, load_head
from worker_service.runtime.loader import load_model
from worker_service.runtime.runner import SequenceChunk, pack

BLOCK_SIZE = 4


def trained_looking_head(model, seed=0) -> TrainableHead:
    torch.manual_seed(seed)
    draft_to_target = torch.arange(3, 203)
    config = head_config(model.config, len(draft_to_target), default_aux_layers(model.config.num_hidden_layers))
    head = TrainableHead(
        config, model.model.embed_tokens.weight, model.lm_head.weight, model.model.norm.weight, draft_to_target
    )
    with torch.no_grad():  # weights of a trained size, so that the rows differ
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1)
    return head


def test_each_unrolled_step_equals_the_serving_head_at_that_depth(tiny_pair, tmp_path):
    model = load_model(tiny_pair.target_path)
    trainable = trained_looking_head(model)
    trainable.save(tmp_path / "head")
    # fp32 activations: what training computes (int8 ones, the serving default, round each row's inputs)
    served = load_head(tmp_path / "head", facts(model), model.model.embed_tokens, model.device, "fp32")
    served.init_cache(32, BLOCK_SIZE)
    # The served head reads bf16 weights, its linears served as HEAD_WEIGHT_FORMAT blocks: train with the same.
    with torch.no_grad():
        for p in trainable.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        for module in trainable.modules():
            if type(module) is torch.nn.Linear and module.in_features % QBLOCK == 0:
                module.weight.copy_(BlockWeight.quantize(module.weight, HEAD_WEIGHT_FORMAT).dequantize())
    tokens = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(1))
    aux = torch.randn(1, 12, 3 * model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = trainable(tokens, aux, num_steps=3)  # per step [1, 11, draft V]
    table = list(range(8))
    p = 6  # the context ends at x_{p+1}: catch-up over rows 0..p, then two draft steps
    batch = pack([SequenceChunk(tokens[0, 1 : p + 2].tolist(), 0, table)], served.kv_cache, model.device)
    normed, prenorm = served(batch.input_ids, batch.positions, served.features(aux[0, : p + 1]), batch.metadata)
    torch.testing.assert_close(served.lm_head(normed), logits[0][0, : p + 1], rtol=1e-4, atol=1e-4)
    feature = prenorm[-1:]
    for j in (1, 2):
        batch = pack([SequenceChunk([tokens[0, p + j + 1].item()], p + j, table)], served.kv_cache, model.device)
        normed, feature = served(batch.input_ids, batch.positions, feature, batch.metadata)
        torch.testing.assert_close(served.lm_head(normed)[0], logits[j][0, p], rtol=1e-4, atol=1e-4)
