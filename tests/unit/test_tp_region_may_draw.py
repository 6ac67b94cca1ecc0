"""Note [TP regions under torch.compile]: which attention modules may draw random numbers."""

from torch import nn
from transformers import GPT2Config, LlamaConfig
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.llama.modeling_llama import LlamaAttention

from torch_sagemaker.tensor_parallel.plan import region_may_draw


def _llama(**kw):
    cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, **kw)
    return LlamaAttention(cfg, 0).train()


def test_dropout_rates_decide_in_training_and_eval_draws_nothing():
    assert not region_may_draw(_llama())  # attention_dropout 0, SMP's setting
    assert region_may_draw(_llama(attention_dropout=0.1))
    assert not region_may_draw(_llama(attention_dropout=0.1).eval())
    # GPT-2: its config's attention and residual rates count, its other rates do not.
    assert region_may_draw(GPT2Attention(GPT2Config(n_embd=32, n_head=4)).train())
    zero = GPT2Config(n_embd=32, n_head=4, attn_pdrop=0.0, resid_pdrop=0.0)
    assert zero.summary_first_dropout > 0
    assert not region_may_draw(GPT2Attention(zero).train())


def test_a_rate_under_another_name_or_no_rate_at_all_may_draw():
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_dropout = 0.0
            self.resid_pdrop = 0.1  # applied by its own forward

    assert region_may_draw(Custom().train())
    assert region_may_draw(nn.Linear(2, 2).train())  # nothing says it draws nothing
