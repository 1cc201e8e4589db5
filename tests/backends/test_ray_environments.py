"""Multi-turn environments on environment-worker actors (`placement.environment_workers`,
`backends/ray/environments.py`), on the session's Ray cluster and real time: an episode played
there is the one played in the controller; an environment's failures, its deadline and the
failure budget read as they do in the controller; a worker killed under its episodes fails
them (one line each, counted) and is replaced; and a run's rollout plays its episodes there."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import ray

import pipeline
from backends.placement import Placed
from backends.ray.actors import ENVIRONMENT_GROUPS, EnvironmentWorker
from backends.ray.environments import EnvironmentPool
from pipeline.clock import DeadlineClock
from pipeline.contracts.errors import DropBudgetExceeded
from pipeline.contracts.messages import Prompt
from pipeline.environments import resolve
from pipeline.gate import EngineGate
from pipeline.logs import reset_warnings
from pipeline.shell.run import start_backend
from pipeline.testing import FakeEngine, FakeTrainer
from stages.episodes import Episode, Episodes
from stages.program import run_program
from stages.rollout import RolloutSection
from tests.stages.test_episodes import TOKENIZER, ScriptedEngine

GUESS = "pipeline.environments.guess:GuessNumber"
HERE = "tests.backends.ray_environments"
# The scripted engine guesses 0, then 1, then 2: found at the third turn.
PROMPT = Prompt(prompt_id="p0", text="?", tokens=tuple(TOKENIZER.encode("?")), answer="2")

SMALL = ["prompts.prompts_per_step=2", "eval.every_steps=0", "gates.checks=[]"]

Pools = Callable[..., EnvironmentPool]


@pytest.fixture
def pools(ray_cluster: Any) -> Iterator[Pools]:
    """Builds pools of environment workers (`pools(name, workers=1)`) as the Ray placement
    does, with its counts in `pool.counts`; kills their actors after the test."""
    actors: list[Any] = []
    remote = ray.remote(concurrency_groups=ENVIRONMENT_GROUPS)(EnvironmentWorker)

    def build(name: str, workers: int = 1, **args: Any) -> EnvironmentPool:
        def spawn() -> tuple[Any, int]:
            actor = remote.options(num_cpus=0, max_restarts=0).remote(name, args)
            actors.append(actor)
            return actor, ray.get(actor.pid.remote())

        return EnvironmentPool(spawn, workers, counts=Counter())

    yield build
    for actor in actors:
        ray.kill(actor)


async def play(
    factory: Callable[[], Any], counts: Counter[str], prompt: Prompt = PROMPT, **section: Any
) -> Episode | BaseException:
    """One episode against the scripted engine, on real time; its result or what it raised."""
    clock = DeadlineClock()
    episodes = Episodes(
        RolloutSection(**{"max_retries": 0, **section}),
        factory=factory,
        tokenizer=TOKENIZER,
        gate=EngineGate(ScriptedEngine(), clock),
        clock=clock,
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(clock.run)
        await anyio.wait_all_tasks_blocked()  # the clock's timer is up
        try:
            return await episodes.run(prompt, counts=counts)
        except Exception as error:
            return error
        finally:
            tg.cancel_scope.cancel()


def held(pool: EnvironmentPool) -> list[int]:
    """The environments each worker's actor holds now."""
    return ray.get([w.actor.episodes.remote() for w in pool.workers])


async def logged(log: Path, lines: list[str]) -> bool:
    """Whether `log` holds `lines` within 120 s (a hang guard: a loaded machine is slow)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if log.exists() and log.read_text().splitlines() == lines:
            return True
        await anyio.sleep(0.01)
    return False


def let_go(pool: EnvironmentPool) -> bool:
    """Whether every worker lets go of its environments within 120 s (a `close` is sent and not
    awaited, and an async actor runs its calls in no fixed order; a hang guard on a loaded
    machine)."""
    deadline = time.monotonic() + 120
    while any(held(pool)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not any(held(pool)) and not any(w.in_hand for w in pool.workers)


async def test_an_episode_on_a_worker_is_the_one_played_in_the_controller(pools: Pools) -> None:
    pool = pools(GUESS, max_guesses=4)
    here, there = Counter[str](), Counter[str]()
    local = await play(resolve(GUESS, {"max_guesses": 4}), here)
    remote = await play(pool.environment, there)
    assert isinstance(local, Episode) and isinstance(remote, Episode)
    assert (remote.tokens, remote.loss_mask, remote.logprobs) == (
        local.tokens,
        local.loss_mask,
        local.logprobs,
    )
    assert (remote.reward, remote.info, remote.stats.turns) == (1.0, {"success": 1.0, "guesses": 3.0}, 3)
    assert (local.reward, local.info, local.stats.turns) == (1.0, {"success": 1.0, "guesses": 3.0}, 3)
    assert here == there
    assert let_go(pool)  # the episode's environment, once it ended


@pytest.mark.parametrize(
    ("name", "section", "reason"),
    [
        (f"{HERE}:Raises", {}, "step raised KeyError: 'board'"),
        (f"{HERE}:Malformed", {}, "step returned dict, not an Observation"),
        (f"{HERE}:Stalls", {"env_s": 0.5}, "step took longer than rollout.env_s=0.5 s"),
    ],
    ids=["raises", "malformed", "deadline"],
)
async def test_an_environment_failure_on_a_worker_reads_as_in_the_controller(
    pools: Pools, tmp_path: Path, name: str, section: dict[str, Any], reason: str
) -> None:
    log = tmp_path / "stalls.log"
    pool = pools(name, **({"log": str(log)} if name.endswith("Stalls") else {}))
    counts: Counter[str] = Counter()
    stalling = Prompt(prompt_id="p0", text="?", tokens=PROMPT.tokens, answer="stall")
    episode = await play(pool.environment, counts, stalling, **section)
    assert isinstance(episode, Episode)
    assert (episode.reward, episode.stats.failed, counts["env_failures"]) == (None, reason, 1)
    assert let_go(pool)
    if name.endswith("Stalls"):  # the step past its deadline was cancelled in the worker too
        assert await logged(log, ["stalled", "cancelled"])


async def test_failures_on_a_worker_past_the_budget_stop_the_run(pools: Pools) -> None:
    raised = await play(pools(f"{HERE}:Raises").environment, Counter(env_failures=2), max_env_failures=2)
    assert isinstance(raised, DropBudgetExceeded)
    assert str(raised) == (
        "3 episodes failed by their environment, over rollout.max_env_failures=2; "
        "last: step raised KeyError: 'board'"
    )


async def test_a_worker_killed_under_its_episodes_fails_them_and_is_replaced(
    pools: Pools, tmp_path: Path
) -> None:
    log = tmp_path / "stalls.log"
    pool = pools(f"{HERE}:Stalls", log=str(log))
    counts: Counter[str] = Counter()
    stalling = Prompt(prompt_id="p0", text="?", tokens=PROMPT.tokens, answer="stall")
    results: list[Any] = []
    dead = pool.workers[0].pid

    async def one() -> None:
        results.append(await play(pool.environment, counts, stalling))

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(one)
        assert await logged(log, ["stalled"] * 3)  # every episode in its step
        os.kill(dead, signal.SIGKILL)
    assert len(results) == 3 and all(isinstance(r, Episode) for r in results)
    for episode in results:
        assert episode.reward is None
        assert episode.stats.failed.startswith(
            "step raised EnvironmentWorkerLost: its environment worker died ("
        )
        assert "\n" not in episode.stats.failed
    assert (counts["env_failures"], pool.counts["environment_worker_restarts"]) == (3, 1)
    # The next episode runs on the new worker.
    after = await play(pool.environment, counts)
    assert isinstance(after, Episode) and after.reward == 1.0
    assert pool.workers[0].pid != dead and let_go(pool)


async def test_an_episode_that_starts_on_a_dead_worker_starts_again_on_its_replacement(pools: Pools) -> None:
    pool = pools(f"{HERE}:Stalls")
    dead = pool.workers[0].pid
    os.kill(dead, signal.SIGKILL)  # idle: no episode of it sees the death before the next start
    counts: Counter[str] = Counter()
    episode = await play(pool.environment, counts)
    assert isinstance(episode, Episode) and episode.reward == 1.0
    assert (counts["env_failures"], pool.counts["environment_worker_restarts"]) == (0, 1)
    assert pool.workers[0].pid != dead and let_go(pool)


async def test_an_environment_that_blocks_its_workers_loop_is_reported_and_env_s_still_fires(
    pools: Pools, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An environment's step holds its worker's event loop in a synchronous sleep: its own call
    and the start of an episode sent to the same worker meanwhile each fail by `env_s` (the
    controller's deadline fires), and one warning names the worker whose loop is held."""
    reset_warnings()
    log = tmp_path / "blocks.log"
    pool = pools(f"{HERE}:Blocks", log=str(log), seconds=6.0)
    counts: Counter[str] = Counter()
    blocking = Prompt(prompt_id="p0", text="?", tokens=PROMPT.tokens, answer="block")
    results: dict[str, Any] = {}

    async def one(name: str, prompt: Prompt) -> None:
        results[name] = await play(pool.environment, counts, prompt, env_s=2.0)

    with caplog.at_level(logging.WARNING, logger="backends.ray.environments"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "blocks", blocking)
            assert await logged(log, ["blocking"])
            tg.start_soon(one, "beside", PROMPT)
    failed = {name: r.stats.failed for name, r in results.items() if isinstance(r, Episode)}
    assert failed == {
        "blocks": "step took longer than rollout.env_s=2 s",
        "beside": "start took longer than rollout.env_s=2 s",
    }
    warnings = [r.getMessage() for r in caplog.records if r.name == "backends.ray.environments"]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"an environment has held its worker's event loop (pid {pool.workers[0].pid}) for "
    )
    assert let_go(pool)


def test_a_runs_rollout_plays_its_episodes_on_the_workers(tmp_path: Path, pools: Pools) -> None:
    """The multi-turn recipe with the placement's environment factory (fake engine and trainer):
    every episode's environment is one the pool made."""
    pool = pools(GUESS, max_guesses=4)
    made: list[Any] = []

    def environment() -> Any:
        made.append(pool.environment())
        return made[-1]

    recipe = pipeline.load_recipe(
        "recipes/multi-turn-cpu.yaml",
        [f"run.dir={tmp_path / 'run'}", "run.progress=false", "run.plot=false", "run.steps=2", *SMALL],
    )

    def start(recipe: Any, build: bool) -> tuple[Any, Placed]:
        checked, _ = start_backend(recipe, False)
        placed = Placed(
            engine=FakeEngine(), trainer=FakeTrainer(), close=lambda: None, environment=environment
        )
        return checked, placed

    summary = anyio.run(lambda: run_program(recipe, start=start))
    assert summary.steps_done == 2 and summary.last_metrics["env/failures"] == 0
    assert len(made) >= 2 * 2 * recipe.rollout.samples_per_prompt
    assert all(env.held is None for env in made) and let_go(pool)
