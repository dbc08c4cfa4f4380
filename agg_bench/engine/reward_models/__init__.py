"""Learned reward models, each an optional extra loaded from local checkpoint files.

One module per reward, each exposing ``build(options, device) -> reward(images, prompts) -> (B,)``;
:mod:`agg_bench.engine.rewards` registers them by name as ``"module:attr"`` strings, so a reward's packages
are imported only when that reward is built.

============  ============================================  ======================================
name          model                                         score
============  ============================================  ======================================
hpsv2         OpenCLIP ViT-H-14 + HPSv2(.1) weights          cosine(image, text)
pickscore     transformers CLIP-H (PickScore_v1)            logit_scale * cosine
imagereward   BLIP ViT-L + BERT cross-attention + head      standardised head output
clipscore     transformers CLIP                             2.5 * max(cosine, 0)
aesthetic     CLIP ViT-L/14 image embedding + LAION head    head output (prompt ignored)
============  ============================================  ======================================

Images are made 8-bit and preprocessed with PIL as each model's reference code does
(:class:`~agg_bench.engine.reward_models.common.ClipTransform`, or transformers' PIL processor for PickScore); scoring
runs in ``options["batch_size"]`` chunks (default 16) under ``torch.no_grad()`` with the model in eval mode.
"""
