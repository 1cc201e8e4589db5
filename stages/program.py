"""Runs the GRPO pipeline for a recipe, from the run directory's lock to its verdict: the run's
lifecycle. The stages and their channels are wired in `stages.wiring`; the pipeline's own state
in a checkpoint is `stages.run_state`.

`run_program` reads the checkpoint to resume from and has the backend built off the event loop
(by the `start` the shell gives it: `pipeline.shell.run`), loads the checkpoint into it, takes
the run directory's lock, moves the earlier start's files aside, and runs the pipeline to the
last step or a clean stop, saving on the way out; then it closes the metrics, the backend and
the console, writes the trace and gives the gates' verdict, whatever way the run ended.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import msgspec

from pipeline.algorithms.presets import algorithm_of
from pipeline.clock import DeadlineClock, TimeSource
from pipeline.contracts.errors import BackendLost, PipelineError
from pipeline.contracts.protocols import Engine, Trainer
from pipeline.environments import EnvironmentFactory
from pipeline.logs import reset_warnings
from pipeline.metrics import MetricsLog
from pipeline.recipe import dump
from pipeline.rewards.scoring import RewardFn
from pipeline.runner import StopRequest, first_error, reclaim_signals
from pipeline.sinks import open_sinks
from pipeline.startup import start_up, thaws_after
from pipeline.trace import Trace
from pipeline.watchdog import Watchdog
from stages.checkpoint import (
    RECIPE_FILE,
    Checkpointer,
    CheckpointError,
    Resumed,
    clean_orphans,
    newest,
    open_resume,
)
from stages.context import RunContext
from stages.gates import Verdict, give_verdict
from stages.prompts import PromptSet
from stages.run_dir import RunDirLock, keep_earlier_runs, record_stop
from stages.run_state import restore
from stages.timings import BatchTimings
from stages.wiring import Pipeline

if TYPE_CHECKING:
    from backends.placement import Placed
    from pipeline.shell.console import Console
    from pipeline.shell.preflight import Checked
    from pipeline.shell.recipe import Recipe

log = logging.getLogger("stages.program")

T = TypeVar("T")

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
        checked, placed = await _owned(start, recipe, built, dispose=lambda started: _close(started[1]))
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
            environment=checked.environment,
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


async def _owned(fn: Callable[..., T], *args: Any, dispose: Callable[[T], None]) -> T:
    """`fn(*args)` on a worker thread, whose result is handed to `dispose` if the awaiting task is
    cancelled first: a host's `task.cancel()` gets through anyio's shield and leaves the thread
    running, and what it builds (a model, Ray's runtime and actors) must not outlive the run."""
    lock = threading.Lock()
    abandoned = False
    done: list[T] = []

    def work() -> T:
        result = fn(*args)
        with lock:
            done.append(result)
            late = abandoned
        if late:
            dispose(result)
        return result

    try:
        return await anyio.to_thread.run_sync(work)
    except BaseException:
        with lock:
            abandoned = True
            finished = list(done)
        for result in finished:  # it returned, but the cancellation came first
            dispose(result)
        raise


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
    environment: EnvironmentFactory | None,
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
        admitted = algorithm_of(recipe).admitted(recipe.prompts.prompts_per_step)
        state, evaluated = restore(
            resumed, run_dir=run_dir, checkpoints=checkpoints, prompts=prompts, admitted=admitted
        )
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
    wired = Pipeline(
        recipe,
        context,
        state=state,
        prompts=prompts,
        reward_fn=reward_fn,
        environment=environment,
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
