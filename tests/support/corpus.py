"""The real-model corpus: models as users bring them, one ``Job`` each, and the harness that
builds them, loads them on real gloo ranks and compares them with eager PyTorch.

Every model is tiny (2 layers, width 32, sequence 16, 2 sequences or images per rank), randomly
initialized from a config built here (no downloads) and seeded inside its factory, so the
build, the eager oracle and the compiled job start from the same weights in any process.
Configs keep transformers' defaults (dropout, ``use_cache``, attention implementation) except
where a variant says otherwise. ``corpus:NAME`` is a CLI target for every model (``job(NAME)``).

Parity: each rank runs 5 AdamW steps eagerly (DDP, ``fully_shard``, ``parallelize_module`` from
the model's own transformers TP plan or the entry's ``plan``), again with every initial
parameter perturbed by relative 1e-7 (the job's own rounding floor), and loaded; the loaded run
must be within max(1e-5, 10 x floor). The floor is what makes models with gradients that are
zero in exact arithmetic comparable: attention key biases (softmax ignores a shift) get
rounding-sized gradients that AdamW turns into lr-sized steps (CLIP's floor is ~2e-3).

Dropout stays on where the config has it (GPT-2, BERT, T5: 0.1): the stored graph draws from
the global RNG with eager's ops in eager's order (README "Dropout / RNG"), so with the same seed
per data-parallel rank the masks are the same and parity is exact up to rounding, not
statistical.

Shared by ``tests/models/test_corpus.py`` and ``tools/bench/run_corpus.py``.
"""

from __future__ import annotations

import dataclasses
import io
import math
import statistics
import sys
import time
import traceback
from typing import Any
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import spmd_aot
from spmd_aot.examples.models import train_step as logits_step  # logits + cross_entropy, as ours is written

VOCAB, SEQ, BATCH, IMAGE, CLASSES = 128, 16, 2, 32, 10
MEL = 8  # Whisper's mel bins; its encoder reads 2 x SEQ frames
STEPS = 5
TOL = 1e-5  # README: parameters, optimizer state and losses within 1e-5 in fp32 after 5 steps
PERTURBATION = 1e-7  # relative; the eager run against itself with this perturbation is the job's floor


def _quiet_transformers():
    """transformers warns about tiny configs (token ids outside a 128 vocabulary, loss_type=None)."""
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


# ---------------------------------------------------------------------------- steps
def hf_step(model, optim, batch):
    """What a user writes first for a transformers model: ``model(input_ids=x, labels=y).loss``
    (the batch is the dict of keyword arguments: input_ids/pixel_values and labels)."""
    loss = model(**batch).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def contrastive_step(model, optim, batch):
    """CLIP's contrastive loss as its model card trains it: ``model(..., return_loss=True).loss``."""
    loss = model(**batch, return_loss=True).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def hf_eval_step(model, batch):
    """A forward-only evaluation step: the loss and the logits."""
    out = model(**batch)
    return out.loss, out.logits


# ---------------------------------------------------------------------------- batches
def _generator(rank: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * rank + step)


def lm_batch(rank: int = 0, step: int = 0) -> dict:
    """Causal LM: the labels are the inputs (transformers shifts them)."""
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=_generator(rank, step))
    return {"input_ids": x, "labels": x.clone()}


def mlm_batch(rank: int = 0, step: int = 0) -> dict:
    """Masked LM: every 4th token replaced by [MASK] (id 3) and predicted, the rest ignored (-100)."""
    x = torch.randint(5, VOCAB, (BATCH, SEQ), generator=_generator(rank, step))
    masked = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    masked[:, ::4] = True
    return {"input_ids": x.masked_fill(masked, 3), "labels": x.masked_fill(~masked, -100)}


def seq2seq_batch(rank: int = 0, step: int = 0) -> dict:
    g = _generator(rank, step)
    return {"input_ids": torch.randint(1, VOCAB, (BATCH, SEQ), generator=g),
            "labels": torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=g)}


def image_batch(rank: int = 0, step: int = 0) -> dict:
    g = _generator(rank, step)
    return {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g),
            "labels": torch.randint(0, CLASSES, (BATCH,), generator=g)}


def audio_seq2seq_batch(rank: int = 0, step: int = 0) -> dict:
    """Whisper: log-mel features (the encoder's 2 x SEQ frames) and decoder labels."""
    g = _generator(rank, step)
    return {"input_features": torch.randn(BATCH, MEL, 2 * SEQ, generator=g),
            "labels": torch.randint(4, VOCAB, (BATCH, SEQ // 2), generator=g)}


def text_image_batch(rank: int = 0, step: int = 0) -> dict:
    """CLIP: captions ending in the end-of-text token (the text tower pools there) and images,
    caption i describing image i."""
    g = _generator(rank, step)
    captions = torch.randint(0, VOCAB - 1, (BATCH, SEQ), generator=g)
    captions[:, -1] = VOCAB - 1
    return {"input_ids": captions, "pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g)}


def token_pair_batch(rank: int = 0, step: int = 0):
    """Ours: (inputs, next-token targets)."""
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=_generator(rank, step))
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


# ---------------------------------------------------------------------------- our nanoGPT-style GPT
@dataclasses.dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = VOCAB
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class GPTMLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class GPTBlock(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = GPTMLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's model as written there: tied token embedding and head, learned positions from
    ``torch.arange``, GPT-2 init with the scaled residual projections."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([GPTBlock(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


# ---------------------------------------------------------------------------- the models
def _decoder(config_cls: str, model_cls: str, **overrides) -> nn.Module:
    """A transformers decoder LM: 2 layers, width 32, 4 query heads over 2 key/value heads (GQA)."""
    t = _quiet_transformers()
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    return getattr(t, model_cls)(getattr(t, config_cls)(**{**fields, **overrides}))


def _gpt2(**overrides):
    t = _quiet_transformers()
    config = t.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                          bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, **overrides)
    return t.GPT2LMHeadModel(config)


def _bert(**overrides):
    t = _quiet_transformers()
    return t.BertForMaskedLM(t.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, intermediate_size=64,
                                          max_position_embeddings=64, **overrides))


def _t5(**overrides):
    t = _quiet_transformers()
    return t.T5ForConditionalGeneration(t.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                   num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                                                   **overrides))


def _vit(**overrides):
    t = _quiet_transformers()
    return t.ViTForImageClassification(t.ViTConfig(image_size=IMAGE, patch_size=8, hidden_size=32,
                                                   num_hidden_layers=2, num_attention_heads=2,
                                                   intermediate_size=64, num_labels=CLASSES, **overrides))


def _resnet(**overrides):
    t = _quiet_transformers()
    return t.ResNetForImageClassification(t.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                                         layer_type="basic", num_labels=CLASSES, **overrides))


def _whisper(**overrides):
    t = _quiet_transformers()
    return t.WhisperForConditionalGeneration(t.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=MEL, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=SEQ, max_target_positions=SEQ, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=3, **overrides))


def _clip(**overrides):
    t = _quiet_transformers()
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=SEQ, eos_token_id=VOCAB - 1)
    vision = dict(image_size=IMAGE, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2)
    return t.CLIPModel(t.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16, **overrides))


def _mamba(**overrides):
    t = _quiet_transformers()
    return t.MambaForCausalLM(t.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2,
                                            expand=2, conv_kernel=4, **overrides))


def _swin(**overrides):
    t = _quiet_transformers()
    return t.SwinForImageClassification(t.SwinConfig(image_size=IMAGE, patch_size=4, embed_dim=16, depths=[2, 1],
                                                     num_heads=[2, 2], window_size=4, num_labels=CLASSES,
                                                     **overrides))


def _convnext(**overrides):
    t = _quiet_transformers()
    return t.ConvNextForImageClassification(t.ConvNextConfig(num_stages=2, patch_size=4, hidden_sizes=[16, 32],
                                                             depths=[1, 1], num_labels=CLASSES, **overrides))


def _gpt_neox(**overrides):
    t = _quiet_transformers()
    return t.GPTNeoXForCausalLM(t.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, intermediate_size=64,
                                                max_position_embeddings=64, **overrides))


def _bloom(**overrides):
    t = _quiet_transformers()
    return t.BloomForCausalLM(t.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, **overrides))


def _lora(**overrides):
    """peft LoRA (rank 4) on a tiny Llama's q/v projections: only the adapters train, every
    base parameter is frozen (``requires_grad=False``)."""
    import peft

    base = _decoder("LlamaConfig", "LlamaForCausalLM", **overrides)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


# ---------------------------------------------------------------------------- a torchtitan-style Llama
@dataclasses.dataclass
class TitanArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = VOCAB
    ffn_hidden: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 64


def precompute_freqs_cis(dim: int, end: int, theta: float) -> torch.Tensor:
    """The rotary frequencies as complex numbers (torchtitan, Meta's reference Llama)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    freqs = torch.outer(torch.arange(end, device=freqs.device), freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, -1, head_dim)


class TitanAttention(nn.Module):
    def __init__(self, args: TitanArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        n_rep = self.n_heads // self.n_kv_heads
        xq, xk, xv = (z.transpose(1, 2) for z in (xq, repeat_kv(xk, n_rep), repeat_kv(xv, n_rep)))
        out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class TitanFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self, args: TitanArgs):
        super().__init__()
        self.attention = TitanAttention(args)
        self.feed_forward = TitanFeedForward(args.dim, args.ffn_hidden)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


# torchtitan's Llama TP plan for these module names (its parallelize_llama, without sequence parallel)
TITAN_PLAN = {"layers.*.attention.wq": "colwise", "layers.*.attention.wk": "colwise",
              "layers.*.attention.wv": "colwise", "layers.*.attention.wo": "rowwise",
              "layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w3": "colwise",
              "layers.*.feed_forward.w2": "rowwise"}


class TitanLlama(nn.Module):
    """torchtitan's Llama as written there: blocks in an ``nn.ModuleDict`` keyed ``"0"``,
    ``"1"``, ..., complex RoPE from a ``freqs_cis`` buffer, SDPA ``is_causal=True``, an untied
    output projection whose logits are upcast to fp32."""

    def __init__(self, args: TitanArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len,
                                                               args.rope_theta), persistent=True)
        self.layers = nn.ModuleDict({str(i): TitanBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h)).float()


@dataclasses.dataclass(frozen=True)
class Model:
    """One corpus entry. ``make(**config_overrides)`` builds the module (unseeded: ``factory``
    seeds it); ``tp`` says whether a TP case is run: with ``plan`` where given (a model without a
    transformers plan; ``"hf"``, the model's own plan by name, which skips the patterns it lacks),
    else with the model's own transformers plan written out."""

    make: Callable[..., nn.Module]
    batch: Callable[[int, int], Any]
    step: Callable = hf_step
    eval: bool = False  # a forward-only step (optimizer=None), the model in eval mode
    tp: bool = False
    plan: dict | str | None = None
    about: str = ""


def _p(fn, *args, **kw):
    """``fn`` with ``args`` and ``kw`` fixed, a plain function (its closure is part of the key, as a user's would be)."""
    def make(**overrides):
        return fn(*args, **{**kw, **overrides})
    return make


MODELS: dict[str, Model] = {
    "gpt2": Model(_gpt2, lm_batch, about="GPT-2, default attention (sdpa), dropout 0.1 on"),
    "gpt2_eager": Model(_p(_gpt2, attn_implementation="eager"), lm_batch, about="GPT-2, eager attention"),
    "llama": Model(_p(_decoder, "LlamaConfig", "LlamaForCausalLM"), lm_batch, tp=True,
                   about="Llama, GQA 4/2 heads, default attention (sdpa)"),
    "llama_eager": Model(_p(_decoder, "LlamaConfig", "LlamaForCausalLM", attn_implementation="eager"), lm_batch, tp=True,
                         about="Llama, eager attention"),
    "mistral": Model(_p(_decoder, "MistralConfig", "MistralForCausalLM", sliding_window=8), lm_batch, tp=True,
                     about="Mistral, sliding window 8 < sequence 16"),
    "qwen3": Model(_p(_decoder, "Qwen3Config", "Qwen3ForCausalLM"), lm_batch, tp=True,
                   about="Qwen3, q/k RMSNorm (plan: replicated_with_grad_allreduce)"),
    "gemma": Model(_p(_decoder, "GemmaConfig", "GemmaForCausalLM"), lm_batch, tp=True,
                   about="Gemma, tied embeddings, sqrt(d) embedding scale"),
    "mixtral": Model(_p(_decoder, "MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2),
                     lm_batch, about="Mixtral MoE, default experts implementation (grouped_mm)"),
    "mixtral_batched": Model(_p(_decoder, "MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                                num_experts_per_tok=2, experts_implementation="batched_mm"), lm_batch,
                             tp=True, about="Mixtral MoE, experts_implementation='batched_mm' (static shapes)"),
    "mixtral_loop": Model(_p(_decoder, "MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                             num_experts_per_tok=2, experts_implementation="eager"), lm_batch,
                          about="Mixtral MoE, experts_implementation='eager' (loop over routed experts)"),
    "bert": Model(_bert, mlm_batch, about="BERT masked LM, dropout 0.1 on"),
    "t5": Model(_t5, seq2seq_batch, about="T5 encoder-decoder, dropout 0.1 on"),
    "vit": Model(_vit, image_batch, about="ViT image classification"),
    "resnet": Model(_resnet, image_batch, about="ResNet, BatchNorm"),
    "nanogpt": Model(lambda **kw: GPT(GPTConfig(**kw)), token_pair_batch, step=logits_step,
                     about="ours, nanoGPT style: SDPA is_causal, tied embeddings"),
    "llama_eval": Model(_p(_decoder, "LlamaConfig", "LlamaForCausalLM"), lm_batch, step=hf_eval_step, eval=True,
                        about="Llama forward-only eval step (use_cache default)"),
    "whisper": Model(_whisper, audio_seq2seq_batch, about="Whisper encoder-decoder (audio): conv front end, "
                     "frozen sinusoidal positions"),
    "clip": Model(_clip, text_image_batch, step=contrastive_step,
                  about="CLIP two towers, contrastive loss (return_loss=True)"),
    "mamba": Model(_mamba, lm_batch, about="Mamba state-space LM, sequential scan (CPU slow path)"),
    "swin": Model(_swin, image_batch, about="Swin hierarchical vision: shifted windows, patch merging"),
    "convnext": Model(_convnext, image_batch, about="ConvNeXt: depthwise conv, channels-last LayerNorm, layer scale"),
    "gpt_neox": Model(_gpt_neox, lm_batch, tp=True,
                      about="GPT-NeoX, packed query_key_value (rows grouped per head), partial rotary "
                            "(plan: embedding_rowwise)"),
    "phi3": Model(_p(_decoder, "Phi3Config", "Phi3ForCausalLM", pad_token_id=0), lm_batch, tp=True,
                  about="Phi-3, packed qkv_proj and gate_up_proj (plan: colwise_rep/rowwise_rep)"),
    "bloom": Model(_bloom, lm_batch, about="BLOOM, ALiBi position bias"),
    "gemma2": Model(_p(_decoder, "Gemma2Config", "Gemma2ForCausalLM", sliding_window=8), lm_batch, tp=True,
                    about="Gemma 2, attention and final logit soft-capping, alternating sliding window"),
    "qwen2_moe": Model(_p(_decoder, "Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, shared_expert_intermediate_size=64), lm_batch, tp=True,
                       plan="hf", about="Qwen2-MoE with a shared expert, default experts implementation "
                                        "(plan: tp_plan='hf', which skips its dense-MLP patterns)"),
    "titan_llama": Model(lambda **kw: TitanLlama(TitanArgs(**kw)), token_pair_batch, step=logits_step,
                         tp=True, plan=TITAN_PLAN,
                         about="ours, torchtitan style: complex RoPE, ModuleDict blocks, GQA, SwiGLU"),
    "llama_lora": Model(_lora, lm_batch, about="peft LoRA r=4 on a Llama's q/v: base frozen, adapters train"),
}


def factory(name: str, **config_overrides) -> Callable[[], nn.Module]:
    """The model's zero-argument factory: seeded, so every process and every call gets the same weights."""
    spec = MODELS[name]

    def make_model():
        torch.manual_seed(0)
        model = spec.make(**config_overrides)
        return model.eval() if spec.eval else model
    return make_model


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def job(name: str, **config_overrides) -> spmd_aot.Job:
    spec = MODELS[name]
    return spmd_aot.Job(step=spec.step, model=factory(name, **config_overrides),
                        optimizer=None if spec.eval else adamw, batch=lambda: spec.batch(0, 0))


class Logits(nn.Module):
    """What a user wraps a transformers model in for ``SPMD``: a stored step returns tensors in
    tuples/lists/dicts, not transformers' ``ModelOutput`` classes (nor its ``DynamicCache``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def spmd_job(bare: bool = False) -> spmd_aot.Job:
    """The ``SPMD`` wrapper's job: GPT-2 in eval mode (``Logits`` around it unless ``bare``),
    input_ids split over the ranks (Shard(0))."""
    wrap = (lambda m: m) if bare else Logits
    return spmd_aot.SPMD.job(model=lambda: wrap(factory("gpt2")()).eval(), inputs=spmd_inputs)


def spmd_inputs():
    """The wrapper's GLOBAL input at world 2: every rank's ``input_ids``, concatenated."""
    return torch.cat([lm_batch(r, 0)["input_ids"] for r in range(2)])


def __getattr__(name: str):
    """``corpus:NAME`` as a CLI target: a zero-argument callable returning the model's Job."""
    if name in MODELS:
        return lambda: job(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def tp_plan(name: str) -> dict:
    """The corpus entry's ``plan``, else the model's own transformers TP plan
    (``config.base_model_tp_plan``), as the user passes it."""
    spec = MODELS[name]
    return dict(spec.plan) if isinstance(spec.plan, dict) else dict(factory(name)().config.base_model_tp_plan)


# ---------------------------------------------------------------------------- building
@dataclasses.dataclass
class Built:
    cache: str
    rc: int = 0
    seconds: float = 0.0
    output: str = ""  # the CLI's stdout and stderr (the error, with a traceback on exit 3)

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def seconds_for(self, placement: str) -> float:
        """One placement's build seconds: the CLI table's SECONDS column (else the whole call)."""
        for row in self.output.splitlines():
            cells = row.split()
            if row.startswith("world=") and placement in cells:
                return float(cells[-2])
        return self.seconds


def cli_build(name: str, cache: str, world: int = 2, placements=("replicate", "shard"),
              target_module: str = "support.corpus") -> Built:
    """``spmd-aot build corpus:NAME -w WORLD -p ...`` in this process, output captured."""
    from spmd_aot.cli.app import main

    argv = ["build", f"{target_module}:{name}", "-w", str(world), *[a for p in placements for a in ("-p", p)],
            "--cache-dir", cache]
    out, saved = io.StringIO(), (sys.stdout, sys.stderr)
    start = time.perf_counter()
    sys.stdout = sys.stderr = out
    try:
        rc = main(argv)
    finally:
        sys.stdout, sys.stderr = saved
    return Built(cache, rc, time.perf_counter() - start, out.getvalue())


def api_build(name: str, cache: str, **options) -> Built:
    """``spmd_aot.build`` (TP plans, whose HF style names the CLI's PATTERN=STYLE cannot take
    as one option), any failure captured as the CLI would print it."""
    start = time.perf_counter()
    try:
        spmd_aot.build(job(name), cache_dir=cache, **options)
        return Built(cache, 0, time.perf_counter() - start)
    except Exception as exc:  # the report names it; the test asserts on rc
        return Built(cache, 2, time.perf_counter() - start, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")


# ---------------------------------------------------------------------------- configurations
# name -> (placement, mesh shape, TP?)
CONFIGS = {"replicate": ("replicate", None, False), "shard": ("shard", None, False),
           "tp": ("replicate", None, True), "fsdp_tp": ("shard", (2, 2), True)}


def compile_options(name: str, config: str) -> dict:
    placement, mesh, tp = CONFIGS[config]
    plan = MODELS[name].plan if isinstance(MODELS[name].plan, str) else tp_plan(name) if tp else None
    return {"placement": placement, "mesh_shape": mesh, **({"tp_plan": plan} if tp else {})}


def _tp_size(config: str, world: int) -> int:
    placement, mesh, tp = CONFIGS[config]
    return (mesh[-1] if mesh else world) if tp else 1


# ---------------------------------------------------------------------------- the eager oracles
def _torch_style(style: str):
    """transformers' style name as torch's ``parallelize_module`` style: ``colwise_rep`` gathers
    the output features (whole on every TP rank), ``rowwise_rep`` takes a whole input and splits it,
    ``embedding_rowwise`` splits the vocabulary of whole token ids (torch masks the ids outside a
    rank's rows and sums the partial embeddings)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    gathered, split = (lambda: ColwiseParallel(output_layouts=Replicate()),
                       lambda: RowwiseParallel(input_layouts=Replicate()))
    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "embedding_rowwise": split,
            "colwise_rep": gathered, "colwise_gather_output": gathered, "rowwise_rep": split,
            "rowwise_split_input": split}[style]()


def _allreduce_grads_over(module: nn.Module, group) -> None:
    """transformers' ``replicated_with_grad_allreduce``: whole parameters whose gradients are
    partial per TP rank (q/k norms see only the rank's heads), summed over TP."""
    import torch.distributed as dist

    for p in module.parameters():
        p.register_post_accumulate_grad_hook(lambda q: dist.all_reduce(q.grad, group=group))


def _parallelize(model: nn.Module, plan: dict, mesh) -> None:
    """Eager TP from transformers' plan (its FQNs are relative to the base model)."""
    import fnmatch

    from torch.distributed.tensor.parallel import parallelize_module

    prefix = model.base_model_prefix + "." if hasattr(model, "base_model_prefix") else ""
    styles = {}
    for fqn, module in model.named_modules():
        rel = fqn[len(prefix):] if fqn.startswith(prefix) else None
        style = next((s for pat, s in plan.items() if rel is not None and fnmatch.fnmatchcase(rel, pat)), None)
        if style == "replicated_with_grad_allreduce":
            _allreduce_grads_over(module, mesh.get_group())
        elif style is not None:
            styles[fqn] = _torch_style(style)
    parallelize_module(model, mesh, styles)


def _blocks(model: nn.Module):
    """The children of the model's ModuleLists (the transformer layers): FSDP2 wraps each."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return [block for lst in lists for block in lst]


def eager_model(name: str, config: str, world: int, perturb: bool = False):
    """The model as eager PyTorch distributes it: DDP (replicate), ``fully_shard`` (shard), TP
    from the model's transformers plan (+ ``fully_shard`` per layer and root over dp)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model = factory(name)()
    if perturb:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.abs() * PERTURBATION * (torch.randint(0, 2, p.shape, generator=g) * 2 - 1))
    placement, mesh_shape, tp = CONFIGS[config]
    if tp:
        shape = mesh_shape or (world,)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp")[-len(shape):])
        _parallelize(model, tp_plan(name), mesh["tp"])
        if placement == "shard":
            for block in model.model.layers:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        return model, model
    if placement == "shard":
        _fully_shard_with_scalars(model, init_device_mesh("cpu", (world,)))
        return model, model
    return model, DistributedDataParallel(model)


def _fully_shard_with_scalars(model: nn.Module, mesh) -> None:
    """``fully_shard`` refuses 0-d parameters (CLIP's ``logit_scale``): as a user does, leave
    them out (``ignored_params``) and average their gradients over the ranks, as DDP would."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    scalars = {p for p in model.parameters() if p.dim() == 0}
    for p in scalars:
        p.register_post_accumulate_grad_hook(lambda q: dist.all_reduce(q.grad, op=dist.ReduceOp.AVG))
    fully_shard(model, mesh=mesh, ignored_params=scalars or None)


def _timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def _train(name, config, rank, world, model, call, optim=None):
    """STEPS steps from the same RNG state (dropout masks: seeded per data-parallel rank, as
    for DDP; the TP ranks of one share draw the same). Returns losses and step seconds."""
    spec = MODELS[name]
    dp_rank = rank // _tp_size(config, world)
    torch.manual_seed(100 + dp_rank)
    losses, seconds = [], []
    for s in range(STEPS):
        args = (model, spec.batch(dp_rank, s)) if spec.eval else (model, optim, spec.batch(dp_rank, s))
        out, dt = _timed(call, *args)
        # an eval step's loss and logits, flattened together: "loss" compares every output
        losses.append(torch.cat([o.detach().flatten() for o in out]) if spec.eval else out.detach())
        seconds.append(dt)
    return losses, seconds


def _diffs(ref, got) -> dict:
    """Largest absolute differences of parameters and buffers, optimizer state and losses
    (``features.max_diffs``); for a forward-only step, of parameters and every output."""
    from support import features

    (ref_model, ref_optim, ref_outputs), (model, optim, outputs) = ref, got
    if ref_optim is not None:
        return features.max_diffs(ref_model, ref_optim, model, optim, ref_outputs, outputs)
    return {"param": max((features.full(a) - features.full(b)).abs().max().item()
                         for a, b in zip(ref_model.state_dict().values(), model.state_dict().values())),
            "loss": max((a - b).abs().max().item() for a, b in zip(ref_outputs, outputs))}


def run_case(name: str, config: str, rank: int, world: int, cache: str) -> dict:
    """On every rank: eager, eager with perturbed weights (the floor), the loaded step
    (``require_hit=True``). Returns the differences, the floor, hit/trace facts and timings."""
    spec = MODELS[name]
    ref_model, wrapped = eager_model(name, config, world)
    ref_optim = None if spec.eval else adamw(wrapped)
    ref_losses, eager_s = _train(name, config, rank, world, wrapped, spec.step, ref_optim)
    floor_model, wrapped = eager_model(name, config, world, perturb=True)
    floor_optim = None if spec.eval else adamw(wrapped)
    floor_losses, _ = _train(name, config, rank, world, wrapped, spec.step, floor_optim)

    model = factory(name)()
    optim = None if spec.eval else adamw(model)
    step = spmd_aot.compile(spec.step, cache_dir=cache, require_hit=True, **compile_options(name, config))
    losses, loaded_s = _train(name, config, rank, world, model, step, optim)
    info = step.cache_info
    ref = (ref_model, ref_optim, ref_losses)
    return {"diff": _diffs(ref, (model, optim, losses)), "floor": _diffs(ref, (floor_model, floor_optim, floor_losses)),
            "hit": info.hit, "source": info.source, "traces": info.traces, "load_s": info.seconds,
            "ratio": statistics.median(loaded_s[1:]) / statistics.median(eager_s[1:]),
            "losses": [float(x.flatten()[0]) for x in losses]}


def run_spmd(rank: int, world: int, cache: str) -> dict:
    """The ``SPMD`` wrapper around GPT-2 (eval) against the DDP-wrapped module, this rank's piece."""
    from torch.nn.parallel import DistributedDataParallel

    wrapper = spmd_aot.SPMD(Logits(factory("gpt2")()).eval(), cache_dir=cache, require_hit=True)
    ref = DistributedDataParallel(Logits(factory("gpt2")()).eval())
    x = spmd_inputs().chunk(world)[rank]
    with torch.no_grad():
        got, want = wrapper(x), ref(x)
    info = wrapper.cache_info
    return {"diff": {"logits": (got - want).abs().max().item()}, "hit": info.hit,
            "source": info.source, "traces": info.traces}


def guarded(fn, *args) -> dict:
    """``fn(*args)``, or the error it raised (one model's failure must not hide the others')."""
    try:
        return fn(*args)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}\n{''.join(traceback.format_exc()[-4000:])}"}


def rank_worker(rank: int, world: int, cases: list) -> dict:
    """Every ``(name, config, cache)`` case in this rank's process, one after the other
    (transformers is imported once per rank, not once per case). ``name == "spmd"``: the wrapper."""
    _quiet_transformers()
    out = {}
    for name, config, cache in cases:
        start = time.perf_counter()
        if name == "spmd":
            out[name, config] = guarded(run_spmd, rank, world, cache)
        else:
            out[name, config] = guarded(run_case, name, config, rank, world, cache)
        out[name, config]["run_s"] = time.perf_counter() - start  # what the case adds to a launch
    return out


def tolerance(result: dict, metric: str) -> float:
    """README's 1e-5, or 10x the job's own floor where AdamW amplifies rounding beyond it."""
    return max(TOL, 10 * result["floor"][metric])


def verdict(result: dict) -> list[str]:
    """What is wrong with one rank's result of one case (empty: it passed)."""
    if "error" in result:
        return [result["error"]]
    problems = []
    if not result["hit"] or result["source"] != "cache" or result["traces"] != 0:
        problems.append(f"hit={result['hit']} source={result['source']} traces={result['traces']}")
    for metric, value in result["diff"].items():
        if "floor" in result and not value <= tolerance(result, metric):
            problems.append(f"{metric} diff {value:.3g} > tolerance {tolerance(result, metric):.3g}")
        elif "floor" not in result and not value <= TOL:
            problems.append(f"{metric} diff {value:.3g} > {TOL}")
    return problems


# ---------------------------------------------------------------------------- the whole corpus
FSDP_TP_MODEL = "llama"  # FSDP x TP at world 4, mesh (2, 2)
SPMD_TARGET = "spmd_job"


def cases(names=None) -> list[tuple[str, str]]:
    """Every (model, configuration) the corpus checks; ``("spmd", "replicate")`` is the wrapper."""
    names = list(MODELS) if names is None else names
    out = [(n, c) for n in names for c in ("replicate", "shard")]
    out += [(n, "tp") for n in names if MODELS[n].tp]
    out += [(FSDP_TP_MODEL, "fsdp_tp")] if FSDP_TP_MODEL in names else []
    return out + [("spmd", "replicate")]


@dataclasses.dataclass
class CorpusRun:
    builds: dict  # (name, config) -> Built
    results: dict  # (name, config) -> [one dict per rank]
    seconds: float


def _launch_results(future, launched) -> dict:
    """A whole launch that failed (a rank died, a timeout): every case it ran gets the error."""
    try:
        per_rank = future.result()
    except Exception as exc:
        per_rank = [{case: {"error": f"launch failed: {type(exc).__name__}: {exc}"} for case in launched}]
    return {case: [r[case] for r in per_rank] for case in launched}


def run_corpus(root, names=None, group_size: int = 4, timeout: float = 900.0) -> CorpusRun:
    """Build every case here (the CLI for replicate + shard, ``spmd_aot.build`` for the TP plans)
    and run each group of models on 2 gloo ranks while the next group builds; FSDP x TP on 4."""
    import pathlib

    from support.multiproc import start_ranks

    start = time.perf_counter()
    names = list(MODELS) if names is None else names
    wanted = set(cases(names))
    builds, launches = {}, []

    def launch(world, group_cases):
        ok = [(n, c, builds[n, c].cache) for n, c in group_cases if builds[n, c].ok]
        if ok:
            launches.append((start_ranks(rank_worker, world, ok, timeout=timeout), [(n, c) for n, c, _ in ok]))

    if (FSDP_TP_MODEL, "fsdp_tp") in wanted:  # the longest launch first
        cache = str(pathlib.Path(root) / f"{FSDP_TP_MODEL}-w4")
        builds[FSDP_TP_MODEL, "fsdp_tp"] = api_build(FSDP_TP_MODEL, cache, world_size=4,
                                                     **compile_options(FSDP_TP_MODEL, "fsdp_tp"))
        launch(4, [(FSDP_TP_MODEL, "fsdp_tp")])
    groups = [names[i:i + group_size] for i in range(0, len(names), group_size)]
    for i, group in enumerate(groups):
        group_cases = []
        for name in group:
            cache = str(pathlib.Path(root) / name)
            builds[name, "replicate"] = builds[name, "shard"] = cli_build(name, cache)
            group_cases += [(name, "replicate"), (name, "shard")]
            if (name, "tp") in wanted:
                builds[name, "tp"] = api_build(name, cache, world_size=2, **compile_options(name, "tp"))
                group_cases.append((name, "tp"))
        if i == len(groups) - 1:
            cache = str(pathlib.Path(root) / "spmd")
            builds["spmd", "replicate"] = cli_build(SPMD_TARGET, cache, placements=("replicate",))
            group_cases.append(("spmd", "replicate"))
        launch(2, group_cases)
    results = {}
    for future, launched in launches:
        results.update(_launch_results(future, launched))
    return CorpusRun(builds, results, time.perf_counter() - start)
