"""Assembles and runs the GRPO pipeline for a recipe: the one place that wires stages together."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from pipeline.channel import Channel
from pipeline.clock import DeadlineClock, TimeSource
from pipeline.gate import EngineGate
from pipeline.messages import Batch, Dropped, Group
from pipeline.metrics import MetricsLog
from pipeline.protocols import Engine, Trainer
from pipeline.recipe import dump
from pipeline.runner import StopRequest, run_stages
from pipeline.tickets import TicketBox
from pipeline.trace import Trace
from pipeline.watchdog import Watchdog
from stages.faults import FaultyEngine
from stages.progress import Progress
from stages.prompts import PromptStage, build_prompts
from stages.recipe import Recipe
from stages.reward import RewardStage, resolve
from stages.rollout import RolloutStage
from stages.train import Evaluation, TrainStage


class RunSummary(msgspec.Struct, frozen=True, kw_only=True):
    run_dir: str
    steps_done: int
    policy_version: int
    stopped: bool
    dropped_groups: int
    last_metrics: dict[str, Any]


async def run_program(
    recipe: Recipe,
    *,
    engine: Engine | None = None,
    trainer: Trainer | None = None,
    time_source: TimeSource | None = None,
    stop: StopRequest | None = None,
    echo: Callable[[dict[str, Any]], None] | None = None,
) -> RunSummary:
    """Run `recipe` to its last step (or a clean stop). `engine`/`trainer` replace the backend."""
    run_dir = Path(recipe.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.yaml").write_text(dump(recipe))
    seed = recipe.run.seed
    random.seed(seed)
    prompts = build_prompts(recipe.prompts, seed)
    if engine is None or trainer is None:
        from backends.torch.build import build_backend

        engine, trainer = build_backend(
            recipe, vocab_size=prompts.tokenizer.vocab_size, eos_id=prompts.tokenizer.eos_id
        )
    clock = DeadlineClock(time_source)
    if recipe.faults.enabled:
        engine = FaultyEngine(engine, recipe.faults, time=clock.source, seed=seed)
    stop = stop or StopRequest()
    trace = Trace(clock.source.now())
    gate = EngineGate(engine, clock, on_transition=lambda name, start, end: trace.span(name, start, end, track="gate"))
    lookahead = recipe.async_rl.max_lookahead_versions
    tickets = TicketBox(lookahead)
    progress = Progress(steps=recipe.run.steps)
    per_step = recipe.prompts.prompts_per_step
    batches: Channel[Batch] = Channel("batches", lookahead + 1)
    generated: Channel[Group | Dropped] = Channel("generated", per_step * (lookahead + 1))
    scored: Channel[Group | Dropped] = Channel("scored", per_step * (lookahead + 1))
    watchdog = Watchdog(clock.source, stall_s=recipe.watchdog.stall_s, fail=recipe.watchdog.fail)
    reward_fn = resolve(recipe.reward.function)
    metrics = MetricsLog(run_dir / "metrics.jsonl", wandb_run=_wandb(recipe, run_dir))

    rollout = RolloutStage(recipe.rollout, gate=gate, clock=clock, inp=batches, out=generated, watchdog=watchdog)
    reward = RewardStage(
        recipe.reward, fn=reward_fn, tokenizer=prompts.tokenizer, clock=clock, inp=generated, out=scored, watchdog=watchdog
    )

    def counters() -> dict[str, float]:
        return {
            "rollout/timeouts": rollout.counts["timeouts"],
            "rollout/retries": rollout.counts["retries"],
            "rollout/engine_errors": rollout.counts["engine_errors"],
            "rollout/dropped_groups_total": rollout.counts["dropped_groups"],
            "rollout/poisoned_samples_total": rollout.counts["poisoned_samples"],
            "reward/failures": reward.counts["failures"],
        }

    evaluation = None
    if recipe.eval.every_steps:
        evaluation = Evaluation(recipe.eval, prompts=prompts.heldout, fn=reward_fn, decode=prompts.tokenizer.decode)
    train = TrainStage(
        trainer=trainer,
        gate=gate,
        tickets=tickets,
        progress=progress,
        inp=scored,
        metrics=metrics,
        trace=trace,
        clock=clock,
        watchdog=watchdog,
        prompts_per_step=per_step,
        first_batch=0,
        counters=counters,
        evaluation=evaluation,
        echo=echo,
    )
    stages = [
        PromptStage(
            prompts.train,
            prompts_per_step=per_step,
            tickets=tickets,
            out=batches,
            progress=progress,
            watchdog=watchdog,
        ),
        rollout,
        reward,
        train,
    ]

    def on_stop() -> None:
        progress.stop()
        tickets.close()

    try:
        outcome = await run_stages(
            stages, clock=clock, watchdog=watchdog, stop=stop, on_stop=on_stop, grace_s=recipe.run.stop_grace_s
        )
    finally:
        metrics.close()
        trace.write(run_dir / "trace.json")
    return RunSummary(
        run_dir=str(run_dir),
        steps_done=progress.steps_done,
        policy_version=gate.engine_version,
        stopped=outcome.stopped,
        dropped_groups=rollout.counts["dropped_groups"],
        last_metrics=metrics.last,
    )


def _wandb(recipe: Recipe, run_dir: Path) -> Any:
    if not recipe.wandb.enabled:
        return None
    import wandb

    return wandb.init(
        project=recipe.wandb.project,
        mode=recipe.wandb.mode,
        dir=str(run_dir),
        config=msgspec.to_builtins(recipe),
    )
