"""fp32 linear layers through oneDNN (mkldnn) on the CPU.

Profiling SmolLM2 decode steps showed ~80% of the time in `aten::mm`, and
`F.linear` in fp32 reaches only about half of the memory bandwidth at 1 row
(the 49152x576 output layer: 10.7 ms with F.linear, 5.4 ms through oneDNN
with its weight pre-packed) and gets 2-3x slower from 2 rows on, while oneDNN
stays nearly flat (7.4 ms at 5 rows). See bench/bench_worker.py.

Only the output layer is switched: oneDNN sums in another order than MKL, and
over 30 layers that moved SmolLM2's logits by 1.5e-4 from `transformers`
(beyond the 1e-4 the paged-KV tests hold); at the output layer alone the
difference stays around 1e-6, and that layer is a fifth of the weights.
"""

import logging

import torch

logger = logging.getLogger(__name__)


class MkldnnLinear(torch.nn.Module):
    """A bias-free or biased Linear whose weight is pre-packed for oneDNN."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().to_mkldnn(), persistent=False)
        bias = linear.bias.detach().to_mkldnn() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()  # [N, in]
        out = torch._C._nn.mkldnn_linear(rows.to_mkldnn(), self.weight, self.bias).to_dense()  # [N, out]
        return out.view(*x.shape[:-1], self.out_features)


def can_use_mkldnn(model: torch.nn.Module) -> bool:
    return model.device.type == "cpu" and model.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def use_mkldnn_output_layer(model: torch.nn.Module) -> bool:
    """Switches an fp32 CPU causal LM's `lm_head` to oneDNN in place; False when it does not apply."""
    head = getattr(model, "lm_head", None)
    if type(head) is not torch.nn.Linear or not can_use_mkldnn(model):
        return False
    model.lm_head = MkldnnLinear(head)
    logger.info("using oneDNN for the fp32 output layer")
    return True
