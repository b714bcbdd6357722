"""The reference forward: `transformers`' decoder layers, their attention our registered paged attention."""

import torch
from transformers import PreTrainedModel

from worker_service.runtime.attention import PagedMetadata


class TransformersForward:
    """model.model's own forward (any decoder model `transformers` loads), over the paged KV cache."""

    name = "transformers"
    # Its attention is the dispatch (kernels/paged_attention.py): the C kernel on the CPU, where it reads K
    # transposed (kv_cache.transposes_keys says where).
    transposed_keys = True
    bf16_cache_under_fp32 = False

    def __init__(self, model: PreTrainedModel):
        self.model = model

    @staticmethod
    def supports(model: PreTrainedModel) -> str | None:
        """Every model: None."""
        return None

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: PagedMetadata,
        rows: torch.Tensor,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ForwardBackend.__call__."""
        out = self.model.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            paged_metadata=meta,
            output_hidden_states=bool(aux_layers),
        )
        hidden = out.last_hidden_state[0][rows]  # [N, hidden]
        # hidden_states[i]: the input of layer i ([0] the embeddings)
        aux = torch.cat([out.hidden_states[i][0] for i in aux_layers], dim=-1) if aux_layers else None
        return hidden, aux
