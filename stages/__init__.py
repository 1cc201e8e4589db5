"""The RL content of the pipeline: prompts, rollout, reward, train and checkpoint stages."""
