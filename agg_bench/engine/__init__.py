"""The engine: what one GRPO update computes.

The model families' specs (families/), the DiT policies and their conditioning (models, text, prompts,
lora, architectures, pixel_decoder), the sampler (sampler, solvers, rollout), advantages, the clipped loss and
its upstream gradients (grpo), which steps each sample trains (trained_steps), the pass counter (counters) and
the rewards (rewards, scenes, scene_reward, reward_models/). It imports the top-level basics and the machine
wing; never methods, runtime, results, tools or the baselines (``tests/unit/test_import_graph.py``).
"""
