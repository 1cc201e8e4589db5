"""Assembles and runs the GRPO pipeline for a recipe: the one place that wires stages together.

    PromptStage --batches--> RolloutStage --generated--> RewardStage --scored--> TrainStage
    (admission)  (L+1 deep)  (engine, via   (groups,     (reward fn)  (groups,   (BatchAssembler ->
         ^                    the gate)      drops)                    drops)     step -> StepRecorder)
         |                                                                          |  weights: refit,
         +---------------------- tickets (L+1): back once a step is published -----+  or the wake
                                                                                    +-> checkpoints/

Channels hold `prompts_per_step * (L+1)` groups (`batches`: L+1 batches), so nothing queues past
what the tickets admit. Every stage takes the one `RunContext` (clock, trace, watchdog, timings,
metrics). `run_program` reads the checkpoint to resume from and has the backend built off the event
loop (by the `start` the shell gives it: `pipeline.shell.run`), loads the checkpoint into it,
takes the run directory's lock, and
runs the stages (`_Pipeline`) to the last step or a clean stop, saving on the way out.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from pipeline.algorithms.presets import algorithm_of
from pipeline.channel import Channel
from pipeline.clock import DeadlineClock, TimeSource
from pipeline.contracts.errors import BackendLost, PipelineError
from pipeline.contracts.messages import Batch, Dropped, Group
from pipeline.contracts.protocols import Engine, Fingerprinted, SlotStatistics, Trainer
from pipeline.gate import EngineGate
from pipeline.logs import reset_warnings
from pipeline.metrics import MetricsLog
from pipeline.recipe import dump
from pipeline.rewards.scoring import RewardFn
from pipeline.runner import Stage, StopRequest, first_error, reclaim_signals, run_stages
from pipeline.sinks import open_sinks
from pipeline.startup import start_up, thaws_after
from pipeline.tickets import TicketBox
from pipeline.trace import Trace
from pipeline.watchdog import Watchdog
from stages.admission import PromptStage
from stages.batch_assembly import BatchAssembler
from stages.checkpoint import (
    RECIPE_FILE,
    Checkpointer,
    CheckpointError,
    PipelineState,
    Resumed,
    abandon_newer,
    clean_orphans,
    newest,
    open_resume,
    python_rng_state,
    restore_metrics,
    set_aside,
    set_python_rng_state,
)
from stages.checkpoint_writer import CheckpointWriter
from stages.context import RunContext
from stages.evaluation import Evaluation
from stages.faults import FaultyEngine
from stages.gates import Verdict, give_verdict
from stages.progress import Progress
from stages.prompts import PromptSet
from stages.reward import RewardStage
from stages.rollout import RolloutStage
from stages.run_dir import RunDirLock, keep_earlier_runs, record_stop
from stages.step_record import StepRecorder, lag_buckets
from stages.timings import BatchTimings
from stages.train import TrainStage

if TYPE_CHECKING:
    from backends.placement import Placed
    from pipeline.shell.console import Console
    from pipeline.shell.preflight import Checked
    from pipeline.shell.recipe import Recipe

log = logging.getLogger("stages.program")

# The recipe's checks, then (when asked: True) its backend, built where `placement` says; on a
# worker thread. The shell gives it (`pipeline.shell.run`): the stages never import a backend.
Start = Callable[["Recipe", bool], "tuple[Checked, Placed | None]"]


class RunSummary(msgspec.Struct, frozen=True, kw_only=True):
    run_dir: str
    steps_done: int
    policy_version: int
    stopped: bool
    dropped_groups: int
    last_metrics: dict[str, Any]
    passed: bool  # every gate of recipe.gates passed (true without gates)
    verdict: Verdict  # each gate's value and result, as in run_dir/gates.json


@thaws_after  # start-up froze what it built: the run's backend is reclaimed once it ends
async def run_program(
    recipe: Recipe,
    *,
    start: Start,
    engine: Engine | None = None,
    trainer: Trainer | None = None,
    time_source: TimeSource | None = None,
    stop: StopRequest | None = None,
    echo: Callable[[dict[str, Any]], None] | None = None,
    on_eval: Callable[[dict[str, Any]], None] | None = None,
    console: Console | None = None,
    checkpoint_hook: Callable[[str], None] | None = None,
) -> RunSummary:
    """Run `recipe` to its last step (or a clean stop). `start` checks the recipe and builds its
    backend; `engine`/`trainer` replace the backend (then `start` only checks).

    `echo` is called with each train step's metrics record, `on_eval` with each evaluation's
    (step 0: before training); `console` shows the run.
    """
    reset_warnings()
    run_dir = Path(recipe.run.dir)
    # Nothing is written to run.dir until the checkpoint, the data and the model have loaded.
    lock = RunDirLock(run_dir)
    lock.check_free()
    seed = recipe.run.seed
    random.seed(seed)
    built = engine is None or trainer is None  # then the backend is ours to build and to close
    # Start-up work (reading the checkpoint and data, importing torch, building the model) runs
    # off the event loop, so a host application embedding the pipeline keeps its turns; and
    # without the garbage collector's full passes, which hold the GIL 100-300 ms each.
    with start_up():
        resume = await anyio.to_thread.run_sync(open_resume, run_dir, recipe)
        checked, placed = await anyio.to_thread.run_sync(start, recipe, built)
    reclaim_signals()  # from what the backend's native code installed (Ray's SIGTERM handler)
    prompts, reward_fn = checked.prompts, checked.reward_fn
    if placed is not None:
        engine, trainer = placed.engine, placed.trainer
    assert engine is not None and trainer is not None
    try:
        resumed = None
        if resume is not None:
            resumed = await anyio.to_thread.run_sync(resume.load, (trainer, engine))
        lock.acquire()
        seen = resume.newest if resume is not None else None  # the newest when it looked
        if recipe.checkpoint.resume == "auto" and newest(run_dir / "checkpoints") != seen:
            raise PipelineError(
                f"run.dir: another run wrote a checkpoint to {run_dir} while this one loaded; start again"
            )
    except BaseException:
        lock.release()
        _close(placed)
        raise
    try:
        return await _run_locked(
            recipe,
            run_dir=run_dir,
            resumed=resumed,
            prompts=prompts,
            reward_fn=reward_fn,
            engine=engine,
            trainer=trainer,
            placed=placed,
            time_source=time_source,
            stop=stop,
            echo=echo,
            on_eval=on_eval,
            console=console,
            checkpoint_hook=checkpoint_hook,
        )
    except BaseException:
        _close(placed)  # also where the run failed before its own clean-up began
        raise
    finally:
        lock.release()


def _close(placed: Placed | None) -> None:
    """Let go of the backend this run built: threads, actors (closing twice is harmless)."""
    if placed is not None:
        placed.close()


async def _run_locked(
    recipe: Recipe,
    *,
    run_dir: Path,
    resumed: Resumed | None,
    prompts: PromptSet,
    reward_fn: RewardFn,
    engine: Engine,
    trainer: Trainer,
    placed: Placed | None,
    time_source: TimeSource | None,
    stop: StopRequest | None,
    echo: Callable[[dict[str, Any]], None] | None,
    on_eval: Callable[[dict[str, Any]], None] | None,
    console: Console | None,
    checkpoint_hook: Callable[[str], None] | None,
) -> RunSummary:
    """The run, once run.dir is locked and everything it needs has loaded."""
    keep_earlier_runs(run_dir, fresh=resumed is None)
    (run_dir / RECIPE_FILE).write_text(dump(recipe))
    checkpoints = Checkpointer(
        run_dir / "checkpoints", keep_last=recipe.checkpoint.keep_last, hook=checkpoint_hook
    )
    clean_orphans(checkpoints.root)
    checkpoints.check_writable()
    state, evaluated = None, set[int]()
    if resumed is not None:
        state = resumed.state
        set_aside(resumed.damaged)
        abandon_newer(checkpoints.root, resumed)
        prompts.train.skip(state.next_batch * algorithm_of(recipe).admitted(recipe.prompts.prompts_per_step))
        set_python_rng_state(state.python_rng)
        evaluated = restore_metrics(run_dir, state)
        checkpoints.last_step = state.step
        log.info("resumed from %s (step %d) in %.3f s", resumed.saved.path, state.step, resumed.load_s)
    clock = DeadlineClock(time_source)
    context = RunContext(
        clock=clock,
        trace=Trace(clock.source.now),
        watchdog=Watchdog(clock.source, stall_s=recipe.watchdog.stall_s, fail=recipe.watchdog.fail),
        timings=BatchTimings(),
        metrics=MetricsLog(
            run_dir,
            open_sinks(
                recipe.wandb,
                recipe.tensorboard,
                run_dir,
                msgspec.to_builtins(recipe),
                resume_step=state.step if state is not None else None,
            ),
        ),
    )
    wired = _Pipeline(
        recipe,
        context,
        state=state,
        prompts=prompts,
        reward_fn=reward_fn,
        engine=engine,
        trainer=trainer,
        placed=placed,
        checkpoints=checkpoints,
        echo=_both(echo, console.record if console else None),
        on_eval=_both(on_eval, console.evaluation if console else None),
    )
    if state is not None and wired.evaluation is not None:  # owed when a kill during it lost it
        due = wired.evaluation.due(state.step, recipe.run.steps)
        wired.train.owed_eval = due and state.step not in evaluated
    failing = False
    try:
        if console is not None and console.live:
            outcome = await _beside(lambda: wired.run(stop), console.refresh, wired.snapshot)
        else:
            outcome = await wired.run(stop)
        if outcome.stopped:
            await wired.final_save()
        await wired.saves.drain()  # the last step's write
    except anyio.get_cancelled_exc_class():
        failing = True
        with anyio.CancelScope(shield=True):
            await _never_masking(wired.final_save, "the save on cancellation")
        # The embedding task's cancellation is a clean stop: said as the CLI says its stops.
        log.warning(
            "cancelled: stopped after %d steps (policy version %d); %s",
            wired.progress.steps_done,
            wired.gate.engine_version,
            wired.saved_note(),
        )
        raise
    except Exception as error:
        failing = True
        # A last save, when the state allows one (a lost trainer took its state with it).
        if not isinstance(error, CheckpointError | BackendLost):
            with anyio.CancelScope(shield=True):
                await _never_masking(wired.final_save, "the last save")
        raise
    finally:
        with anyio.CancelScope(shield=True):
            await wired.saves.settle()  # no write cut off by closing the backend under it
        steps = [
            ("closing the metrics", context.metrics.close),
            ("closing the backend", lambda: _close(placed)),
            ("writing trace.json", lambda: context.trace.write(run_dir / "trace.json")),
            ("closing the console", console.close if console is not None else lambda: None),
        ]
        # On a worker thread: closing the sinks (wandb) and writing the trace take a while.
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(lambda: _close_all(steps, failing=failing))
    stopped_at = wired.progress.steps_done if outcome.stopped else None
    if stopped_at is not None:
        record_stop(run_dir, stopped_at)  # `check` then skips the gates it never reached
    verdict = await anyio.to_thread.run_sync(
        give_verdict, run_dir, recipe.gates, recipe.run.steps, stopped_at
    )
    return RunSummary(
        run_dir=str(run_dir),
        steps_done=wired.progress.steps_done,
        policy_version=wired.gate.engine_version,
        stopped=outcome.stopped,
        dropped_groups=wired.rollout.counts["dropped_groups"],
        last_metrics=context.metrics.last,
        passed=verdict.passed,
        verdict=verdict,
    )


class _Pipeline:
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
        self._slots_before = (0, 0)  # the engine's slot steps and busy slot steps at the last step
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
        self.rollout = RolloutStage(
            recipe.rollout, gate=self.gate, inp=batches, out=generated, context=context
        )
        self.reward = RewardStage(
            recipe.reward,
            fn=reward_fn,
            tokenizer=prompts.tokenizer,
            score=placed.score if placed is not None else None,
            inp=generated,
            out=scored,
            context=context,
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

    def idle_slots(self) -> dict[str, float]:
        """The fraction of the engine's slots (row x decode step) with no row generating since
        the last step (finished rows waiting for a refill), from an engine with `statistics()`."""
        if not isinstance(self.backend_engine, SlotStatistics):
            return {}
        stats = self.backend_engine.statistics()
        slots = stats.slot_steps - self._slots_before[0]
        busy = stats.busy_slot_steps - self._slots_before[1]
        self._slots_before = (stats.slot_steps, stats.busy_slot_steps)
        return {"rollout/idle_slot_fraction": 1 - busy / slots} if slots else {}

    def counters(self) -> dict[str, float]:
        rollout, reward = self.rollout.counts, self.reward.counts
        return {
            **self.idle_slots(),
            "rollout/timeouts": rollout["timeouts"],
            "rollout/retries": rollout["retries"],
            "rollout/engine_errors": rollout["engine_errors"],
            "rollout/dropped_groups_total": rollout["dropped_groups"],
            "rollout/poisoned_samples_total": rollout["poisoned_samples"],
            "reward/failures": reward["failures"],
            **({"eval/skipped": self.evaluation.counts["skipped"]} if self.evaluation is not None else {}),
            **(self.placed.counters() if self.placed is not None else {}),
            **self.saves.figures(),
        }

    async def save(self, step: int, next_batch: int, record: dict[str, Any] | None) -> None:
        state = PipelineState(
            step=step,
            policy_version=self.gate.engine_version,
            next_batch=next_batch,
            rollout_counts=dict(self.rollout.counts),
            reward_counts=dict(self.reward.counts),
            empty_batches=self.progress.empty_batches,
            python_rng=python_rng_state(),
            last_record=record,
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


async def _never_masking(action: Callable[[], Any], what: str) -> None:
    """Run `action` while another error is on its way out: its own failure is logged, not raised."""
    try:
        await action()
    except Exception as error:
        log.error("%s failed too, after the run's error: %s: %s", what, type(error).__name__, error)


def _close_all(steps: list[tuple[str, Callable[[], None]]], *, failing: bool) -> None:
    """Run every clean-up step. While the run's own error propagates (`failing`), a step that
    fails is logged so that it cannot replace that error; otherwise the first failure is raised
    once all steps have run."""
    first: Exception | None = None
    for what, step in steps:
        try:
            step()
        except Exception as error:
            if failing:
                log.error("%s failed too, after the run's error: %s: %s", what, type(error).__name__, error)
            elif first is None:
                first = error
    if first is not None:
        raise first


async def _beside(body: Callable[[], Any], view: Callable[..., Any], *args: Any) -> Any:
    """`await body()` while `view(*args)` runs beside it; the view ends with the body."""
    result: list[Any] = []
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(view, *args)
            result.append(await body())
            tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise first_error(group) from None
    return result[0]


def _both(*hooks: Callable[[dict[str, Any]], None] | None) -> Callable[[dict[str, Any]], None]:
    def call(record: dict[str, Any]) -> None:
        for hook in hooks:
            if hook is not None:
                hook(record)

    return call


def _fingerprints(engine: Any, trainer: Any) -> bool:
    """Whether both sides take weight fingerprints (an engine or trainer passed in by an
    embedding application may predate `fingerprint` in the protocols: its run goes unchecked)."""
    return all(isinstance(part, Fingerprinted) for part in (engine, trainer))
