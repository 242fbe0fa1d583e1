"""Small random models built with Transformers for running vLLM here, nothing
downloaded: the Llama every real-engine test, demo and benchmark shares, and the hybrid
families of issue 31 (sliding windows: Gemma 2, Gemma 3, gpt-oss, Mistral v0.1 style;
Gated DeltaNet: Qwen3-Next; chunked local attention: Llama 4).  Each is seeded and drawn
so that greedy decoding varies (a random model that repeats one token proves little), and
saved with ``save_pretrained``.  CPU attention needs head sizes of 32, 64, 80, ... (not
16)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def tiny_llama(path: str | os.PathLike, *, seed: int = 0, layers: int = 2,
               head_dim: int = 32, kv_heads: int = 2, heads: int = 4) -> Path:
    """A random LlamaForCausalLM (std 0.1 weights, so keys differ visibly), saved with
    ``save_pretrained``.  CPU attention needs head sizes of 32, 64, 80, ... (not 16)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=1024, hidden_size=4 * head_dim, intermediate_size=256,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=8192)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.save_pretrained(path)
    return Path(path)


def _randomize(model: Any, std: float, embed: float | None = None) -> None:
    """Every matrix drawn N(0, std), the embeddings N(0, ``embed``) when given: with the
    defaults (0.02) greedy decoding repeats one token, which proves little."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, embed if embed is not None and "embed" in name else std)


def tiny_gemma2(path: str | os.PathLike, *, seed: int = 0, window: int = 64, layers: int = 4,
                hidden: int = 128, heads: int = 4, kv_heads: int = 2, head_dim: int = 32
                ) -> Path:
    """A random Gemma2ForCausalLM, 4 layers alternating sliding-window (``window``
    tokens) and global attention, head_dim 32, float32: vLLM keeps its hybrid KV cache
    manager on for it (a sliding-window and a full-attention group).  Its embeddings are
    tied (vLLM's Gemma2 has no lm_head), so they are drawn small (0.01) and the layers
    large (0.3): else the residual stream's embedding wins and it repeats its input."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    config = Gemma2Config(vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=kv_heads, head_dim=head_dim,
                          sliding_window=window, max_position_embeddings=8192)
    model = Gemma2ForCausalLM(config)
    _randomize(model, 0.3, embed=0.01)
    model.save_pretrained(path)
    return Path(path)


def tiny_qwen3_next(path: str | os.PathLike, *, seed: int = 0, layers: int = 4,
                    hidden: int = 256, heads: int = 4, kv_heads: int = 2) -> Path:
    """A random Qwen3NextForCausalLM: 4 layers, Gated DeltaNet every other one (a Mamba
    group of conv and recurrent states in vLLM) and full attention between, a small MoE,
    bfloat16 (vLLM's CPU GDN kernel requires it) and head_dim 64 (32 is refused)."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        vocab_size=1024, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64,
        linear_num_value_heads=heads, linear_num_key_heads=kv_heads, linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64,
        full_attention_interval=2, max_position_embeddings=8192)
    model = Qwen3NextForCausalLM(config).to(torch.bfloat16)
    _randomize(model, 0.1)
    model.save_pretrained(path)
    return Path(path)


def tiny_gpt_oss(path: str | os.PathLike, *, seed: int = 0) -> Path:
    """A random GptOssForCausalLM: 4 layers alternating sliding-window (64 tokens) and
    full attention with attention sinks, 4 experts (top 2), head_dim 64, float32."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    config = GptOssConfig(vocab_size=1024, hidden_size=256, intermediate_size=128,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=64, sliding_window=64, num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=8192,
                          tie_word_embeddings=False,
                          layer_types=["sliding_attention", "full_attention"] * 2)
    model = GptOssForCausalLM(config)
    _randomize(model, 0.1)
    model.save_pretrained(path)
    return Path(path)


def tiny_gemma3(path: str | os.PathLike, *, seed: int = 0) -> Path:
    """A random Gemma3ForCausalLM (text): layers 0-2 sliding-window (64 tokens), layer 3
    global, head_dim 32, float32 (vLLM makes one KV cache group of each layer)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=1024, hidden_size=128, intermediate_size=256,
                              num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
                              sliding_window=64, max_position_embeddings=8192,
                              layer_types=["sliding_attention"] * 3 + ["full_attention"],
                              tie_word_embeddings=False)
    config.architectures = ["Gemma3ForCausalLM"]
    model = Gemma3ForCausalLM(config)
    _randomize(model, 0.1)
    model.save_pretrained(path)
    return Path(path)


def tiny_mistral_sliding(path: str | os.PathLike, *, seed: int = 0) -> Path:
    """A random MistralForCausalLM whose every layer attends a sliding window of 64 tokens
    (as Mistral 7B v0.1): one sliding-window KV cache group, no full attention."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    config = MistralConfig(vocab_size=1024, hidden_size=128, intermediate_size=256,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, sliding_window=64, max_position_embeddings=8192,
                           tie_word_embeddings=False)
    model = MistralForCausalLM(config)
    _randomize(model, 0.1)
    model.save_pretrained(path)
    return Path(path)


def tiny_llama4(path: str | os.PathLike, *, seed: int = 0) -> Path:
    """A random Llama4ForCausalLM (text): layers 0-2 chunked local attention (64 tokens),
    layer 3 global without RoPE, 4 experts, head_dim 64, float32."""
    import torch
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(seed)
    config = Llama4TextConfig(vocab_size=1024, hidden_size=256, intermediate_size=128,
                              intermediate_size_mlp=256, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                              num_local_experts=4, num_experts_per_tok=1,
                              interleave_moe_layer_step=1, attention_chunk_size=64,
                              no_rope_layer_interval=4, max_position_embeddings=8192,
                              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    config.architectures = ["Llama4ForCausalLM"]
    model = Llama4ForCausalLM(config)
    _randomize(model, 0.1)
    model.save_pretrained(path)
    return Path(path)


__all__ = ["tiny_gemma2", "tiny_gemma3", "tiny_gpt_oss", "tiny_llama", "tiny_llama4",
           "tiny_mistral_sliding", "tiny_qwen3_next"]


def byte_tokenizer(path: str | os.PathLike) -> Path:
    """Add a tokenizer to the model saved at ``path``: one token per byte of UTF-8 (a
    byte-level BPE without merges, ids 0-255, so it fits every model here), so that text
    prompts are served as an operator sends them, without ``--skip-tokenizer-init``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=_byte_of))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return Path(path)


def _byte_of(ch: str) -> int:
    """The byte ByteLevel's alphabet character ``ch`` stands for (GPT-2's mapping: the
    printable bytes are themselves, the others are shifted past 255)."""
    code = ord(ch)
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if code in printable:
        return code
    return [b for b in range(256) if b not in printable][code - 256]
