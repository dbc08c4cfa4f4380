"""Tiny local diffusers model folders for the real-model code path, built from configs (nothing downloaded).

``write_tiny_pretrained(family, folder)`` builds the family's pipeline from tiny random components, with
tokenizers over a vocabulary written here, and saves it with ``save_pretrained``: exactly the layout of a
real model folder, loaded by the same code users run.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    QwenImagePipeline,
    StableDiffusion3Pipeline,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

from agg_bench.engine.models import TINY_QWEN_VAE, TINY_VAE, build_tiny_transformer

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"
PUNCT = ".,'\"-:!?"
CLIP_TOKENS = 16  # CLIP context of the tiny tokenizers (77 in the real models)
# Words the Qwen tokenizer knows whole: its prompt template and common prompt words. With them the
# template's system part is 34 tokens, the number QwenImagePipeline drops, as with the real tokenizer.
QWEN_WORDS = ("system user assistant Describe the image by detailing color shape size texture quantity text "
              "spatial relationships of objects and background a an on in at with red blue green cat dog two")


def clip_tokenizer() -> CLIPTokenizer:
    """Characters as tokens (no merges), CLIP's special tokens."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in CHARS + PUNCT:
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_TOKENS)


def t5_tokenizer() -> T5Tokenizer:
    """A unigram vocabulary of characters, with and without the word-start marker."""
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [(ch, -3.0) for ch in CHARS + PUNCT] + [("\u2581" + ch, -2.5) for ch in CHARS]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def qwen_tokenizer() -> Qwen2Tokenizer:
    """Byte-level BPE over all 256 bytes with merges learned here from QWEN_WORDS, and the chat specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=1000, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"])
    # every word inside a sentence (" word") and at a line start ("word")
    bpe.train_from_iterator([" " + QWEN_WORDS, *QWEN_WORDS.split()] * 2, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Qwen2Tokenizer(vocab=model["vocab"], merges=merges)
    tok.add_special_tokens({"additional_special_tokens": [
        "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]})
    return tok


def clip_model(cls, hidden: int, projection: int, vocab_size: int):
    return cls(CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=CLIP_TOKENS, projection_dim=projection,
        bos_token_id=0, eos_token_id=1, pad_token_id=1)).eval()


def t5_model(vocab_size: int, width: int) -> T5EncoderModel:
    return T5EncoderModel(T5Config(vocab_size=vocab_size, d_model=width, d_ff=2 * width, d_kv=16, num_layers=1,
                                   num_heads=2, relative_attention_num_buckets=8, decoder_start_token_id=0)).eval()


def qwen_text_encoder(tok: Qwen2Tokenizer, width: int) -> Qwen2_5_VLForConditionalGeneration:
    ids = tok.convert_tokens_to_ids
    special = ids("<|endoftext|>")
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, bos_token_id=special, eos_token_id=special,
                         pad_token_id=special,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=width),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"))
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build_tiny_pipeline(family: str, seed: int = 0):
    """The family's diffusers pipeline with tiny random components (the tiny preset's transformer)."""
    transformer = build_tiny_transformer(family, seed)
    width = transformer.config.joint_attention_dim
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 7)
        if family == "sd3":
            # two CLIPs whose hidden states concatenate to the T5 width and whose projections to the pooled width
            pooled = transformer.config.pooled_projection_dim
            clip = clip_tokenizer()
            return StableDiffusion3Pipeline(
                transformer=transformer, scheduler=scheduler,
                vae=AutoencoderKL(**TINY_VAE, scaling_factor=1.5305, shift_factor=0.0609),
                text_encoder=clip_model(CLIPTextModelWithProjection, width // 2, pooled // 2, len(clip)),
                tokenizer=clip,
                text_encoder_2=clip_model(CLIPTextModelWithProjection, width // 2, pooled // 2, len(clip)),
                tokenizer_2=clip_tokenizer(),
                text_encoder_3=t5_model(len(t5_tokenizer()), width), tokenizer_3=t5_tokenizer())
        if family == "flux":
            clip = clip_tokenizer()
            pooled = transformer.config.pooled_projection_dim
            return FluxPipeline(
                transformer=transformer, scheduler=scheduler,
                vae=AutoencoderKL(**TINY_VAE, scaling_factor=0.3611, shift_factor=0.1159),
                text_encoder=clip_model(CLIPTextModel, pooled, pooled, len(clip)), tokenizer=clip,
                text_encoder_2=t5_model(len(t5_tokenizer()), width), tokenizer_2=t5_tokenizer())
        if family == "qwenimage":
            from diffusers import AutoencoderKLQwenImage

            tok = qwen_tokenizer()
            # a non-trivial latent normalization, so that a missing or inverted one shows in decoded images
            vae = AutoencoderKLQwenImage(**{**TINY_QWEN_VAE, "latents_mean": [0.3, -0.2, 0.1, 0.0],
                                            "latents_std": [1.5, 2.0, 0.5, 1.0]})
            return QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=qwen_text_encoder(tok, width),
                                     tokenizer=tok, transformer=transformer)
    raise ValueError(family)


def write_tiny_pretrained(family: str, folder: str | Path, seed: int = 0) -> Path:
    """Save the tiny pipeline of ``family`` to ``folder`` (diffusers layout) and return the folder."""
    folder = Path(folder)
    build_tiny_pipeline(family, seed).save_pretrained(folder)
    return folder
