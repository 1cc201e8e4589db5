"""The stages of one run and the channels between them, wired from the run context: the map of
`stages.program`, built (`Pipeline`) and run to the end or a clean stop.

    PromptStage --batches--> RolloutStage --generated--> RewardStage --scored--> TrainStage
    (admission)  (L+1 deep)  (engine, via   (groups,     (reward fn)  (groups,   (BatchAssembler ->
         ^                    the gate)      drops)                    drops)     step -> StepRecorder)
         |                                                                          |  weights: refit,
         +---------------------- tickets (L+1): back once a step is published -----+  or the wake
                                                                                    +-> checkpoints/

Channels hold `prompts_per_step * (L+1)` groups (`batches`: L+1 batches; with dynamic sampling,
the prompts a step admits), so nothing queues past what the tickets admit. The pipeline also
owns what reads across its stages: the step record's counters and queue depths, and the saves
(the pipeline's state, `stages.run_state`, with the backend's parts).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.algorithms.presets import algorithm_of
from pipeline.channel import Channel
from pipeline.contracts.messages import Batch, Dropped, Group
from pipeline.contracts.protocols import Engine, Fingerprinted, SlotStatistics, SlotStats, Trainer
from pipeline.environments import EnvironmentFactory
from pipeline.gate import EngineGate
from pipeline.rewards.scoring import RewardFn
from pipeline.runner import Stage, StopRequest, run_stages
from pipeline.tickets import TicketBox
from stages.admission import PromptStage
from stages.batch_assembly import BatchAssembler
from stages.chat_turns import chat_turns
from stages.checkpoint import Checkpointer, PipelineState
from stages.checkpoint_writer import CheckpointWriter
from stages.context import RunContext
from stages.episodes import Episodes
from stages.evaluation import Evaluation
from stages.faults import FaultyEngine
from stages.progress import Progress
from stages.prompts import PromptSet
from stages.reward import RewardStage
from stages.rollout import RolloutStage
from stages.run_state import capture
from stages.step_record import StepRecorder, lag_buckets
from stages.train import TrainStage

if TYPE_CHECKING:
    from backends.placement import Placed
    from pipeline.shell.recipe import Recipe

log = logging.getLogger("stages.program")  # the run's own lines, under the name users filter on


class Pipeline:
    """The stages of one run and the channels between them (the map at the top of this module),
    built from the run context; `run` runs them to the end or a clean stop."""

    def __init__(
        self,
        recipe: Recipe,
        context: RunContext,
        *,
        state: PipelineState | None,
        prompts: PromptSet,
        reward_fn: RewardFn,
        environment: EnvironmentFactory | None,
        engine: Engine,
        trainer: Trainer,
        placed: Placed | None,
        checkpoints: Checkpointer,
        echo: Callable[[dict[str, Any]], None],
        on_eval: Callable[[dict[str, Any]], None],
    ) -> None:
        self.recipe = recipe
        self.placed = placed
        self.context = context
        self.trainer = trainer
        self.checkpoints = checkpoints
        self.saves = CheckpointWriter(checkpoints, now=context.clock.source.now, trace=context.trace)
        self.backend_engine = engine  # checkpoints hold its state; the fault wrapper has none
        self._slots_before = SlotStats(
            slot_steps=0, busy_slot_steps=0, frozen_rows=0, reprefilled_tokens=0, frozen_now=0
        )
        if recipe.faults.enabled:
            engine = FaultyEngine(engine, recipe.faults, time=context.clock.source, seed=recipe.run.seed)
        trace = context.trace
        self.gate = EngineGate(
            engine,
            context.clock,
            version=state.policy_version if state else 0,
            # On the train track, so the transitions nest inside their step's span.
            on_transition=lambda name, start, end: trace.span(name, start, end, track="train"),
            checks=trainer
            if recipe.async_rl.handoff_checks and _fingerprints(self.backend_engine, trainer)
            else None,
        )
        lookahead = recipe.async_rl.max_lookahead_versions
        first_batch = state.next_batch if state else 0
        self.tickets = TicketBox(lookahead, first_batch=first_batch)
        self.progress = Progress(
            steps=recipe.run.steps,
            steps_done=state.step if state else 0,
            empty_batches=state.empty_batches if state else 0,
        )
        algorithm = algorithm_of(recipe)
        per_step = algorithm.admitted(recipe.prompts.prompts_per_step)  # prompts admitted a step
        batches: Channel[Batch] = Channel("batches", lookahead + 1)
        generated: Channel[Group | Dropped] = Channel("generated", per_step * (lookahead + 1))
        scored: Channel[Group | Dropped] = Channel("scored", per_step * (lookahead + 1))
        self.channels = (batches, generated, scored)
        episodes = None
        if environment is not None:  # multi-turn: the environment scores its episodes
            episodes = Episodes(
                recipe.rollout,
                # On the placement's environment workers where it has them, else in this process.
                factory=placed.environment if placed is not None and placed.environment else environment,
                tokenizer=prompts.tokenizer,
                gate=self.gate,
                clock=context.clock,
                chat=chat_turns(recipe.prompts, recipe.rollout, prompts.tokenizer),
            )
        self.rollout = RolloutStage(
            recipe.rollout, gate=self.gate, inp=batches, out=generated, context=context, episodes=episodes
        )
        self.reward = RewardStage(
            recipe.reward,
            fn=reward_fn,
            tokenizer=prompts.tokenizer,
            score=placed.score if placed is not None else None,
            inp=generated,
            out=scored,
            context=context,
            scored_upstream=episodes is not None,
        )
        if state is not None:
            self.rollout.counts.update(state.rollout_counts)
            self.reward.counts.update(state.reward_counts)
        self.evaluation = None
        if recipe.eval.every_steps:
            self.evaluation = Evaluation(
                recipe.eval,
                prompts=prompts.heldout,
                fn=reward_fn,
                decode=prompts.tokenizer.decode,
                rollout=recipe.rollout,
                reward_s=recipe.reward.reward_s,
                clock=context.clock,
                episodes=episodes,
            )
        every = recipe.checkpoint.every_steps
        self.assembler = BatchAssembler(scored, prompts_per_step=per_step, first_batch=first_batch)
        self.train = TrainStage(
            trainer=trainer,
            gate=self.gate,
            tickets=self.tickets,
            progress=self.progress,
            batches=self.assembler,
            records=StepRecorder(
                context,
                max_lag=lag_buckets(recipe.async_rl.max_lookahead_versions, recipe.run.steps) - 1,
                counters=self.counters,
                queues=self.depths,
            ),
            context=context,
            save=self.save,
            check_saves=self.saves.check,
            save_due=lambda step: bool(every) and step % every == 0,
            limits=recipe.train,
            algorithm=algorithm,
            prompts_per_step=recipe.prompts.prompts_per_step,
            evaluation=self.evaluation,
            echo=echo,
            on_eval=on_eval,
        )
        self.stages: list[Stage] = [
            PromptStage(
                prompts.train,
                prompts_per_step=per_step,
                tickets=self.tickets,
                out=batches,
                progress=self.progress,
                context=context,
            ),
            self.rollout,
            self.reward,
            self.train,
        ]

    async def run(self, stop: StopRequest | None) -> Any:
        def on_stop() -> None:
            self.progress.stop()
            self.tickets.close()

        return await run_stages(
            self.stages,
            clock=self.context.clock,
            watchdog=self.context.watchdog,
            stop=stop or StopRequest(),
            on_stop=on_stop,
            grace_s=self.recipe.run.stop_grace_s,
        )

    def depths(self) -> dict[str, int]:
        return {channel.name: channel.statistics().depth for channel in self.channels}

    def snapshot(self) -> dict[str, Any]:
        return {"gate": self.gate.state.value, "queues": self.depths()}

    def decode_figures(self) -> dict[str, float]:
        """Since the last step, from an engine with `statistics()`: the fraction of its slots
        (row x decode step) with no row generating (finished rows waiting for a refill), and
        where its decode loops' time went: their decode steps and mean width (slots a step),
        the milliseconds a decode step took, their prefills and their checks (the device idle
        while the host hands rows over and admits more), and how long the host waited at the
        checks for the device (most of the decode steps' time where the device bounds the loop,
        near 0 where the host does)."""
        if not isinstance(self.backend_engine, SlotStatistics):
            return {}
        now, before = self.backend_engine.statistics(), self._slots_before
        self._slots_before = now
        slots = now.slot_steps - before.slot_steps
        if not slots:
            return {}
        figures = {"rollout/idle_slot_fraction": 1 - (now.busy_slot_steps - before.busy_slot_steps) / slots}
        if steps := now.decode_steps - before.decode_steps:
            loop = now.loop_s - before.loop_s
            check = now.loop_check_s - before.loop_check_s
            prefill = now.loop_prefill_s - before.loop_prefill_s
            wait = now.loop_wait_s - before.loop_wait_s
            figures |= {
                "rollout/decode_steps": steps,
                "rollout/decode_width": slots / steps,
                "timing/decode_step_ms": 1000 * max(0.0, loop - check - prefill) / steps,
                "timing/loop_s": loop,
                "timing/loop_prefill_s": prefill,
                "timing/loop_check_s": check,
                "timing/loop_wait_s": wait,
            }
        return figures

    def counters(self) -> dict[str, float]:
        rollout, reward = self.rollout.counts, self.reward.counts
        return {
            **self.decode_figures(),
            "rollout/timeouts": rollout["timeouts"],
            "rollout/retries": rollout["retries"],
            "rollout/engine_errors": rollout["engine_errors"],
            "rollout/dropped_groups_total": rollout["dropped_groups"],
            "rollout/poisoned_samples_total": rollout["poisoned_samples"],
            "reward/failures": reward["failures"],
            **({"env/failures": rollout["env_failures"]} if self.recipe.rollout.environment else {}),
            **({"eval/skipped": self.evaluation.counts["skipped"]} if self.evaluation is not None else {}),
            **(self.placed.counters() if self.placed is not None else {}),
            **self.saves.figures(),
        }

    async def save(self, step: int, next_batch: int, record: dict[str, Any] | None) -> None:
        state = capture(
            step=step,
            version=self.gate.engine_version,
            next_batch=next_batch,
            rollout_counts=self.rollout.counts,
            reward_counts=self.reward.counts,
            empty_batches=self.progress.empty_batches,
            record=record,
        )
        parts = (self.trainer, self.backend_engine)
        # Once committed, the trace so far, so a run killed later still leaves one.
        trace, snapshot = self.context.trace, self.context.trace.snapshot()
        path = Path(self.recipe.run.dir) / "trace.json"
        await self.saves.save(
            step, parts, state, self.recipe, after_commit=lambda: trace.write(path, snapshot)
        )

    async def final_save(self) -> None:
        """The save of a clean stop; in-step saves go through the gate (which traces them)."""
        # The gate finishes a step it has started even when cancelled, so the trainer and the
        # recorded steps agree; were they to differ, saving would label step k+1's weights as k.
        steps = self.progress.steps_done
        if steps > self.checkpoints.last_step and self.trainer.completed_steps != steps:
            log.error(
                "no checkpoint of step %d: the trainer has completed %d steps, the run recorded %d",
                steps,
                self.trainer.completed_steps,
                steps,
            )
        elif steps > self.checkpoints.last_step:
            clock = self.context.clock
            start = clock.source.now()
            await self.save(steps, self.assembler.next_batch, None)
            self.context.trace.span("save", start, clock.source.now(), track="train")
        await self.saves.drain()  # a stop waits for the write in flight

    def saved_note(self) -> str:
        """Where the run's training is kept, for the line that ends a stopped run."""
        last = self.checkpoints.last_step
        if not last:
            return "no checkpoint saved"
        return f"checkpoint step {last} in {self.checkpoints.root}"


def _fingerprints(engine: Any, trainer: Any) -> bool:
    """Whether both sides take weight fingerprints (an engine or trainer passed in by an
    embedding application may predate `fingerprint` in the protocols: its run goes unchecked)."""
    return all(isinstance(part, Fingerprinted) for part in (engine, trainer))
