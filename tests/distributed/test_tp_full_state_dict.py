"""A full (Hugging Face) state dict loads into a tensor-parallel model with ``load_state_dict``.

Note [Loading full tensors into tensor-parallel parameters] in
``tensor_parallel/full_state_dict.py``. 4 ranks: tensor parallelism 2 alone (two TP groups)
and under FSDP2 over 2 data-parallel ranks; a Llama with tied embeddings too. After loading a
reference model's state dict, the logits equal the reference's and every parameter, gathered,
equals the loaded value.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.hf_models import tiny_llama
from tests.distributed.launcher import run_distributed


def _load_reference_weights(cases) -> dict:
    import torch.sagemaker as tsm
    from torch.distributed.tensor import DTensor

    from torch_sagemaker.sharding.fsdp2 import shard_model

    out = {}
    for sharding, tied in cases:
        tsm.state.reset()
        tsm.init({"tensor_parallel_degree": 2, "hybrid_shard_degree": 2})
        reference = tiny_llama(seed=0, tie_word_embeddings=tied)
        state = {k: v.clone() for k, v in reference.state_dict().items()}
        model = tsm.transform(tiny_llama(seed=1, tie_word_embeddings=tied))
        if sharding == "fsdp2":
            model = shard_model(model)
        result = model.load_state_dict(state)
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
        logits = model(input_ids=ids).logits
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        params = {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for n, p in model.named_parameters()
        }
        out[(sharding, tied)] = (
            (result.missing_keys, result.unexpected_keys),
            (logits - reference(input_ids=ids).logits).abs().max().item(),
            all(torch.equal(params[n], state[n]) for n in params),
        )
    return out


@pytest.mark.distributed
def test_full_state_dict_loads_into_tensor_parallel_model():
    cases = [("none", False), ("none", True), ("fsdp2", False)]
    for rank, out in enumerate(run_distributed(_load_reference_weights, cases, world_size=4)):
        for case in cases:
            keys, logit_diff, params_equal = out[case]
            assert keys == ([], []), (case, rank, keys)
            assert params_equal, (case, rank)
            assert logit_diff < 1e-5, (case, rank, logit_diff)
