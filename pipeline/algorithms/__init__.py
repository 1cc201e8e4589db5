"""The RL algorithm, as plug-ins: advantage estimators, policy losses, loss aggregations, and the
one update loop every trainer backend calls.

A recipe names a preset (`train.algorithm`: grpo, dr_grpo, dapo, gspo, rloo; `presets.py`) and may
set each of its knobs on its own (`train.advantage`, `train.policy_loss`, `train.loss_aggregation`,
`train.clip_low`/`clip_high`, `train.dynamic_sampling`, `train.overlong_buffer`); `resolve` turns
them into one typed `Algorithm` that the stages (advantages, reward shaping, group filtering) and
the trainers (loss, aggregation) read. A custom advantage or loss is named `module:function`.

Depends on the contracts and torch only (the advantages on neither): never on stages or backends.
"""
