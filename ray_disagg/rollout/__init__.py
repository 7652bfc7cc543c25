"""Rollouts on the training groups (GRPO's generation): seeded sampling on the LLM's
vocabulary-parallel logits (:mod:`ray_disagg.rollout.sampling`)."""
