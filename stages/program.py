"""Assembles and runs the GRPO pipeline for a recipe: the one place that wires stages together."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec

from backends.registry import build_backend
from pipeline.channel import Channel
from pipeline.clock import DeadlineClock, TimeSource
from pipeline.console import Console
from pipeline.errors import PipelineError
from pipeline.gate import EngineGate
from pipeline.logs import reset_warnings
from pipeline.messages import Batch, Dropped, Group
from pipeline.metrics import MetricsLog
from pipeline.plot import draw_apart
from pipeline.protocols import Engine, Trainer
from pipeline.recipe import dump
from pipeline.runner import StopRequest, first_error, run_stages
from pipeline.sinks import open_sinks
from pipeline.startup import start_up, thaws_after
from pipeline.tickets import TicketBox
from pipeline.trace import Trace
from pipeline.watchdog import Watchdog
from stages.admission import PromptStage
from stages.checkpoint import (
    RECIPE_FILE,
    Checkpointer,
    CheckpointError,
    PipelineState,
    Resumed,
    clean_orphans,
    newest,
    open_resume,
    python_rng_state,
    restore_metrics,
    set_aside,
    set_python_rng_state,
)
from stages.evaluation import Evaluation
from stages.faults import FaultyEngine
from stages.gates import Verdict, give_verdict
from stages.preflight import Checked, preflight
from stages.progress import Progress
from stages.prompts import PromptSet
from stages.recipe import Recipe
from stages.reward import RewardFn, RewardStage
from stages.rollout import RolloutStage
from stages.run_dir import RunDirLock, keep_earlier_runs
from stages.timings import BatchTimings
from stages.train import TrainStage

log = logging.getLogger("stages.program")


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
    engine: Engine | None = None,
    trainer: Trainer | None = None,
    time_source: TimeSource | None = None,
    stop: StopRequest | None = None,
    echo: Callable[[dict[str, Any]], None] | None = None,
    on_eval: Callable[[dict[str, Any]], None] | None = None,
    console: Console | None = None,
    checkpoint_hook: Callable[[str], None] | None = None,
) -> RunSummary:
    """Run `recipe` to its last step (or a clean stop). `engine`/`trainer` replace the backend.

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
    built = engine is None or trainer is None  # then the backend's threads are ours to close
    # Start-up work (reading the checkpoint and data, importing torch, building the model) runs
    # off the event loop, so a host application embedding the pipeline keeps its turns; and
    # without the garbage collector's full passes, which hold the GIL 100-300 ms each.
    with start_up():
        resume = await anyio.to_thread.run_sync(open_resume, run_dir, recipe)
        checked, backend = await anyio.to_thread.run_sync(_start, recipe, built)
    prompts, reward_fn = checked.prompts, checked.reward_fn
    if backend is not None:
        engine, trainer = backend
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
        _close(engine, trainer, built)
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
            built=built,
            time_source=time_source,
            stop=stop,
            echo=echo,
            on_eval=on_eval,
            console=console,
            checkpoint_hook=checkpoint_hook,
        )
    except BaseException:
        _close(engine, trainer, built)  # also where the run failed before its own clean-up began
        raise
    finally:
        lock.release()


def _close(engine: Engine, trainer: Trainer, built: bool) -> None:
    """Stop the threads of a backend this run built (closing twice is harmless)."""
    if built:
        engine.close()
        trainer.close()


async def _run_locked(
    recipe: Recipe,
    *,
    run_dir: Path,
    resumed: Resumed | None,
    prompts: PromptSet,
    reward_fn: RewardFn,
    engine: Engine,
    trainer: Trainer,
    built: bool,
    time_source: TimeSource | None,
    stop: StopRequest | None,
    echo: Callable[[dict[str, Any]], None] | None,
    on_eval: Callable[[dict[str, Any]], None] | None,
    console: Console | None,
    checkpoint_hook: Callable[[str], None] | None,
) -> RunSummary:
    """The run, once run.dir is locked and everything it needs has loaded."""
    seed = recipe.run.seed
    keep_earlier_runs(run_dir, fresh=resumed is None)
    (run_dir / RECIPE_FILE).write_text(dump(recipe))
    checkpoints = Checkpointer(
        run_dir / "checkpoints", keep_last=recipe.checkpoint.keep_last, hook=checkpoint_hook
    )
    clean_orphans(checkpoints.root)
    checkpoints.check_writable()
    if resumed is not None:
        set_aside(resumed.damaged)
        prompts.train.skip(resumed.state.next_batch * recipe.prompts.prompts_per_step)
        set_python_rng_state(resumed.state.python_rng)
        restore_metrics(run_dir, resumed.state)
        saved = resumed.saved
        log.info("resumed from %s (step %d) in %.3f s", saved.path, saved.state.step, resumed.load_s)
    clock = DeadlineClock(time_source)
    backend_engine = engine  # checkpoints hold its state; the fault wrapper has none of its own
    if recipe.faults.enabled:
        engine = FaultyEngine(engine, recipe.faults, time=clock.source, seed=seed)
    stop = stop or StopRequest()
    trace = Trace(clock.source.now)
    timings = BatchTimings()
    version = resumed.state.policy_version if resumed else 0
    first_batch = resumed.state.next_batch if resumed else 0
    gate = EngineGate(
        engine,
        clock,
        version=version,
        # On the train track, so the transitions nest inside their step's span.
        on_transition=lambda name, start, end: trace.span(name, start, end, track="train"),
        checks=trainer if recipe.async_rl.handoff_checks and _fingerprints(backend_engine, trainer) else None,
    )
    lookahead = recipe.async_rl.max_lookahead_versions
    tickets = TicketBox(lookahead, first_batch=first_batch)
    progress = Progress(
        steps=recipe.run.steps,
        steps_done=resumed.state.step if resumed else 0,
        empty_batches=resumed.state.empty_batches if resumed else 0,
    )
    per_step = recipe.prompts.prompts_per_step
    batches: Channel[Batch] = Channel("batches", lookahead + 1)
    generated: Channel[Group | Dropped] = Channel("generated", per_step * (lookahead + 1))
    scored: Channel[Group | Dropped] = Channel("scored", per_step * (lookahead + 1))
    watchdog = Watchdog(clock.source, stall_s=recipe.watchdog.stall_s, fail=recipe.watchdog.fail)
    metrics = MetricsLog(
        run_dir,
        open_sinks(
            recipe.wandb,
            recipe.tensorboard,
            run_dir,
            msgspec.to_builtins(recipe),
            resume_step=resumed.state.step if resumed else None,
        ),
    )
    queues = (batches, generated, scored)

    def depths() -> dict[str, int]:
        return {q.name: q.statistics().depth for q in queues}

    rollout = RolloutStage(
        recipe.rollout,
        gate=gate,
        clock=clock,
        inp=batches,
        out=generated,
        watchdog=watchdog,
        trace=trace,
        timings=timings,
    )
    reward = RewardStage(
        recipe.reward,
        fn=reward_fn,
        tokenizer=prompts.tokenizer,
        clock=clock,
        inp=generated,
        out=scored,
        watchdog=watchdog,
        trace=trace,
        timings=timings,
    )
    if resumed is not None:
        rollout.counts.update(resumed.state.rollout_counts)
        reward.counts.update(resumed.state.reward_counts)
        checkpoints.last_step = resumed.state.step

    async def save(step: int, next_batch: int, record: dict[str, Any] | None) -> None:
        state = PipelineState(
            step=step,
            policy_version=gate.engine_version,
            next_batch=next_batch,
            rollout_counts=dict(rollout.counts),
            reward_counts=dict(reward.counts),
            empty_batches=progress.empty_batches,
            python_rng=python_rng_state(),
            last_record=record,
        )
        await anyio.to_thread.run_sync(checkpoints.save, step, (trainer, backend_engine), state, recipe)
        # The trace so far, so a run killed later still leaves one.
        await anyio.to_thread.run_sync(trace.write, run_dir / "trace.json", trace.snapshot())

    def counters() -> dict[str, float]:
        return {
            "rollout/timeouts": rollout.counts["timeouts"],
            "rollout/retries": rollout.counts["retries"],
            "rollout/engine_errors": rollout.counts["engine_errors"],
            "rollout/dropped_groups_total": rollout.counts["dropped_groups"],
            "rollout/poisoned_samples_total": rollout.counts["poisoned_samples"],
            "reward/failures": reward.counts["failures"],
            **({"eval/skipped": evaluation.counts["skipped"]} if evaluation is not None else {}),
        }

    evaluation = None
    if recipe.eval.every_steps:
        evaluation = Evaluation(
            recipe.eval,
            prompts=prompts.heldout,
            fn=reward_fn,
            decode=prompts.tokenizer.decode,
            rollout=recipe.rollout,
            reward_s=recipe.reward.reward_s,
            clock=clock,
        )
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
        first_batch=first_batch,
        counters=counters,
        timings=timings,
        max_lag=lookahead,
        queues=depths,
        save_due=lambda step: (
            bool(recipe.checkpoint.every_steps) and step % recipe.checkpoint.every_steps == 0
        ),
        save=save,
        evaluation=evaluation,
        echo=_both(echo, console.record if console else None),
        on_eval=_both(on_eval, console.evaluation if console else None),
        max_empty_in_row=recipe.train.max_consecutive_empty_batches,
        max_skipped_in_row=recipe.train.max_consecutive_skipped_steps,
    )
    stages = [
        PromptStage(
            prompts.train,
            prompts_per_step=per_step,
            tickets=tickets,
            out=batches,
            progress=progress,
            watchdog=watchdog,
            trace=trace,
            timings=timings,
        ),
        rollout,
        reward,
        train,
    ]

    def on_stop() -> None:
        progress.stop()
        tickets.close()

    def consistent() -> bool:
        # A step cancelled after its worker thread finished has changed the weights without
        # being published: saving then would label step k+1's weights as step k.
        return trainer.completed_steps == progress.steps_done

    async def final_save() -> None:
        """The save of a clean stop; in-step saves go through the gate (which traces them)."""
        if progress.steps_done > checkpoints.last_step and consistent():
            start = clock.source.now()
            await save(progress.steps_done, train.next_batch, None)
            trace.span("save", start, clock.source.now(), track="train")

    def snapshot() -> dict[str, Any]:
        return {"gate": gate.state.value, "queues": depths()}

    async def run_all() -> Any:
        return await run_stages(
            stages,
            clock=clock,
            watchdog=watchdog,
            stop=stop,
            on_stop=on_stop,
            grace_s=recipe.run.stop_grace_s,
        )

    def close_backend() -> None:
        _close(backend_engine, trainer, built)

    failing = False
    try:
        if console is not None and console.live:
            outcome = await _beside(run_all, console.refresh, snapshot)
        else:
            outcome = await run_all()
        if outcome.stopped:
            await final_save()
    except anyio.get_cancelled_exc_class():
        failing = True
        with anyio.CancelScope(shield=True):
            await _never_masking(final_save, "the save on cancellation")
        raise
    except Exception as error:
        failing = True
        if not isinstance(error, CheckpointError):  # a last save, when the state allows one
            with anyio.CancelScope(shield=True):
                await _never_masking(final_save, "the last save")
        raise
    finally:
        steps = [
            ("closing the metrics", metrics.close),
            ("closing the backend", close_backend),
            ("writing trace.json", lambda: trace.write(run_dir / "trace.json")),
            ("closing the console", console.close if console is not None else lambda: None),
        ]
        # On a worker thread: closing the sinks (wandb) and writing the trace take a while.
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(lambda: _close_all(steps, failing=failing))
    if recipe.run.plot:
        problem = await draw_apart(run_dir)
        if problem:  # the run is done and saved: a missing plot is not a failure
            log.warning("run.plot: no report.png: %s", problem)
    verdict = await anyio.to_thread.run_sync(give_verdict, run_dir, recipe.gates, recipe.run.steps)
    return RunSummary(
        run_dir=str(run_dir),
        steps_done=progress.steps_done,
        policy_version=gate.engine_version,
        stopped=outcome.stopped,
        dropped_groups=rollout.counts["dropped_groups"],
        last_metrics=metrics.last,
        passed=verdict.passed,
        verdict=verdict,
    )


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


def _start(recipe: Recipe, build: bool) -> tuple[Checked, tuple[Engine, Trainer] | None]:
    """The recipe's checks, then (with `build`) the recipe's backend; on a worker thread."""
    checked = preflight(recipe, model=build, resume=False)  # open_resume read it whole
    if not build:
        return checked, None
    tokenizer = checked.prompts.tokenizer
    return checked, build_backend(recipe, vocab_size=tokenizer.vocab_size, stop_ids=tokenizer.stop_ids)


def _fingerprints(engine: Any, trainer: Any) -> bool:
    """Whether both sides take weight fingerprints (an engine or trainer passed in by an
    embedding application may predate `fingerprint` in the protocols: its run goes unchecked)."""
    return all(callable(getattr(part, "fingerprint", None)) for part in (engine, trainer))
