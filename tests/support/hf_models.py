"""Small random Hugging Face transformers models built in code (nothing downloaded), with a
batch that makes them return their loss, for tests/planner/test_hf_models.py and the other
planner tests that use them.

Decoders get ``use_cache=False``: a KV cache appended in forward would be appended again
in recompute (remat refuses it, naming ``use_cache``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

V, B, L = 64, 2, 64  # vocabulary, batch, sequence: activations, not weights, fill the step
DEPTH = 4


def _ids() -> torch.Tensor:
    return torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(1))


def gpt2() -> tuple[nn.Module, dict[str, Any]]:
    import transformers as T

    cfg = T.GPT2Config(
        vocab_size=V, n_positions=L, n_embd=32, n_layer=DEPTH, n_head=2,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    ids = _ids()
    return T.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids, "use_cache": False}


def llama() -> tuple[nn.Module, dict[str, Any]]:
    import transformers as T

    cfg = T.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=L,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    ids = _ids()
    return T.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids, "use_cache": False}


def mixtral() -> tuple[nn.Module, dict[str, Any]]:
    """A mixture of experts (transformers fuses the experts into one module)."""
    import transformers as T

    cfg = T.MixtralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=L,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    ids = _ids()
    return T.MixtralForCausalLM(cfg), {"input_ids": ids, "labels": ids, "use_cache": False}


def t5() -> tuple[nn.Module, dict[str, Any]]:
    import transformers as T

    cfg = T.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=DEPTH,
        num_decoder_layers=DEPTH, num_heads=4, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1,
    )  # fmt: skip
    ids = _ids()
    labels = ids[:, : L // 2].contiguous()
    return T.T5ForConditionalGeneration(cfg), {
        "input_ids": ids, "labels": labels, "use_cache": False,
    }  # fmt: skip


def bert() -> tuple[nn.Module, dict[str, Any]]:
    import transformers as T

    cfg = T.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=DEPTH, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=L, pad_token_id=0,
    )  # fmt: skip
    ids = _ids()
    return T.BertForMaskedLM(cfg), {"input_ids": ids, "labels": ids}


def vit() -> tuple[nn.Module, dict[str, Any]]:
    import transformers as T

    cfg = T.ViTConfig(
        image_size=32, patch_size=4, num_channels=3, hidden_size=32,
        num_hidden_layers=DEPTH, num_attention_heads=4, intermediate_size=64, num_labels=5,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    return T.ViTForImageClassification(cfg), {
        "pixel_values": torch.randn(B, 3, 32, 32, generator=g),
        "labels": torch.tensor([1, 3]),
    }


def stack(prefix: str) -> list[str]:
    return [f"{prefix}{i}" for i in range(DEPTH)]


# family -> (factory, default blocks)
FAMILIES = {
    "gpt2": (gpt2, stack("transformer.h.")),
    "llama": (llama, stack("model.layers.")),
    "mixtral": (mixtral, stack("model.layers.")),
    "t5": (t5, stack("encoder.block.") + stack("decoder.block.")),
    "bert": (bert, stack("bert.encoder.layer.")),
    "vit": (vit, stack("vit.layers.")),
}


def bart() -> tuple[nn.Module, dict[str, Any]]:
    """An encoder-decoder whose decoder receives the encoder's output in every layer."""
    import transformers as T

    cfg = T.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=L, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=2,
    )  # fmt: skip
    ids = _ids()
    return T.BartForConditionalGeneration(cfg), {
        "input_ids": ids, "labels": ids, "use_cache": False,
    }  # fmt: skip


def deberta() -> tuple[nn.Module, dict[str, Any]]:
    """Relative position embeddings the encoder makes once and passes to every layer."""
    import transformers as T

    cfg = T.DebertaV2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=DEPTH, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=L, relative_attention=True,
        position_buckets=16, pos_att_type=["p2c", "c2p"], pad_token_id=0,
    )  # fmt: skip
    ids = _ids()
    return T.DebertaV2ForMaskedLM(cfg), {"input_ids": ids, "labels": ids}


def neox() -> tuple[nn.Module, dict[str, Any]]:
    """Rotary tables made once and passed to every layer, parallel attention and MLP."""
    import transformers as T

    cfg = T.GPTNeoXConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=DEPTH, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=L, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    ids = _ids()
    return T.GPTNeoXForCausalLM(cfg), {"input_ids": ids, "labels": ids, "use_cache": False}


#: Families checked on plans of their own (beyond those of FAMILIES): factory only.
MORE_FAMILIES = {"bart": bart, "deberta": deberta, "neox": neox}
