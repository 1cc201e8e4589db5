"""Rewards: the built-in reward functions, `resolve` from a recipe's name, and scoring; what the
reward stage and Ray's reward workers share. Imports the contracts, and the engine's real clock
and logging helpers only."""
