"""The quickstart on the session's two-node CPU Ray cluster: it learns, and it survives the
death of an engine replica or a reward worker; a dead trainer stops it with its checkpoint intact.

Each test runs the real pipeline (`run_program`) with `placement.backend: ray`; the Placed
backend the program builds is captured, so the tests can find the actors' processes and kill
them with SIGKILL while they hold work.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

import pipeline
from backends.placement import Placed
from pipeline.contracts.errors import BackendLost
from pipeline.metrics import read
from pipeline.runner import StopRequest
from pipeline.shell import run as shell_run
from stages.checkpoint import committed

RAY = [
    "run.progress=false",
    "run.plot=false",
    "colocated=false",
    "model.threads=1",
    "placement.backend=ray",
    "placement.engine_cpus=0.25",
    "placement.trainer_cpus=0.25",
]
SMALL = [
    "prompts.prompts_per_step=8",
    "rollout.samples_per_prompt=4",
    "eval.every_steps=0",
    "gates.checks=[]",
]


def run(
    tmp_path: Path,
    *overrides: str,
    echo: Callable[[dict[str, Any]], None] | None = None,
    stop: StopRequest | None = None,
) -> Any:
    recipe = pipeline.load_recipe(
        "recipes/quickstart.yaml", [f"run.dir={tmp_path / 'run'}", *RAY, *overrides]
    )
    return anyio.run(lambda: shell_run.run_program(recipe, echo=echo, stop=stop))


def kill_when(holds_work: Callable[[], bool], pid: Callable[[], int]) -> threading.Event:
    """SIGKILL `pid()` from a thread the moment `holds_work()` is true (polled every 0.5 ms)."""
    killed = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not killed.is_set():
            if holds_work():
                os.kill(pid(), signal.SIGKILL)
                killed.set()
            time.sleep(0.0005)

    threading.Thread(target=watch, daemon=True).start()
    return killed


def test_quickstart_with_two_engine_replicas_learns_with_engines_and_trainer_on_two_nodes(
    tmp_path: Path, placements: list[Placed]
) -> None:
    summary = run(
        tmp_path,
        "run.steps=80",
        "placement.engines=2",
        "placement.engine_resources={node_a: 1}",
        "placement.trainer_resources={node_b: 1}",
        "eval.every_steps=40",
        "eval.num_prompts=64",
        # The quickstart's own bar at step 80, and the lag bound L = 1.
        "gates.checks=[{metric: eval/reward, stat: at, step: 80, ge: 0.9}, "
        "{metric: rollout/max_lag, stat: max, le: 1}]",
    )
    assert summary.passed, summary.verdict
    [placed] = placements
    nodes = {r.where["node_id"] for r in placed.engine.replicas}
    assert len(nodes) == 1 and placed.trainer.ranks[0][1]["node_id"] not in nodes
    records = read(tmp_path / "run" / "metrics.jsonl")
    assert max(r["rollout/max_lag"] for r in records) <= 1
    assert {r for _, _, r in placed.engine.events} == {0, 1}  # both replicas served
    # A batch's groups reach a replica together, in one call (not one call each).
    assert sum(r.calls for r in placed.engine.replicas) * 8 < len(placed.engine.events)


def test_an_engine_killed_mid_batch_is_replaced_and_its_requests_sent_again(
    tmp_path: Path, placements: list[Placed]
) -> None:
    killed: list[threading.Event] = []

    def echo(record: dict[str, Any]) -> None:
        if record["step"] == 2:  # after a refit: the new replica must get version 2's weights
            replica = placements[0].engine.replicas[0]
            killed.append(kill_when(lambda: replica.in_flight > 0, lambda: replica.where["pid"]))

    summary = run(tmp_path, "run.steps=6", "placement.engines=2", *SMALL, echo=echo)
    [placed] = placements
    assert killed[0].is_set()
    assert summary.steps_done == 6
    last = summary.last_metrics
    assert last["placement/engine_restarts"] == 1
    redispatched = [rid for kind, rid, _ in placed.engine.events if kind == "redispatch"]
    assert redispatched and last["placement/redispatched_requests"] == len(redispatched)
    first_replica = {rid: r for kind, rid, r in placed.engine.events if kind == "dispatch"}
    assert {first_replica[rid] for rid in redispatched} == {0}  # the same ids, lost on replica 0
    # Every prompt trained exactly once: 6 steps of 8 distinct groups, none dropped.
    assert [len(groups) for groups in placed.trained] == [8] * 6
    assert len(set().union(*placed.trained)) == 48
    assert last["rollout/dropped_groups_total"] == 0
    assert all(placed.agreed)  # the new replica served the trainer's weights


def test_a_reward_worker_killed_while_scoring_is_replaced_and_its_groups_rescored(
    tmp_path: Path, placements: list[Placed]
) -> None:
    killed: list[threading.Event] = []

    def echo(record: dict[str, Any]) -> None:
        if record["step"] == 1:
            pool = placements[0].score.__self__  # type: ignore[union-attr]
            worker = pool.workers[0]
            killed.append(kill_when(lambda: worker.in_hand > 0, lambda: worker.pid))

    summary = run(
        tmp_path, "run.steps=4", "placement.reward_workers=1", "placement.reward_cpus=0.25", *SMALL, echo=echo
    )
    assert killed[0].is_set()
    last = summary.last_metrics
    assert last["placement/reward_worker_restarts"] == 1
    assert last["placement/rescored_groups"] >= 1
    assert last["reward/failures"] == 0
    records = read(tmp_path / "run" / "metrics.jsonl")
    assert [r["rollout/unscored_samples"] for r in records] == [0] * 4
    assert [len(groups) for groups in placements[0].trained] == [8] * 4


def test_a_dead_trainer_stops_the_run_and_leaves_its_last_checkpoint(
    tmp_path: Path, placements: list[Placed]
) -> None:
    def echo(record: dict[str, Any]) -> None:
        if record["step"] == 2:  # snapshotted at step 2 (checkpoint.every_steps=1): step 3 never trains
            os.kill(placements[0].trainer.ranks[0][1]["pid"], signal.SIGKILL)

    with pytest.raises(BackendLost) as raised:
        run(tmp_path, "run.steps=6", "checkpoint.every_steps=1", *SMALL, echo=echo)
    where = placements[0].trainer.ranks[0][1]
    message = str(raised.value)
    assert message.startswith(
        f"placement: trainer rank 0 (pid {where['pid']}, node {where['node_id'][:12]}) died during step 3: "
    )
    assert message.endswith(
        "; the run stops here: its last committed checkpoint is intact, run again to resume from it"
    )
    # Step 2's checkpoint is written in the background from the actor's snapshot: the kill
    # may come before that write is committed, never half through it.
    assert [path.name for path in committed(tmp_path / "run" / "checkpoints")] in (
        ["step-000001"],
        ["step-000001", "step-000002"],
    )
    assert not [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith(".tmp")]


def test_colocated_in_one_actor_then_resumed_on_separate_actors(
    tmp_path: Path, placements: list[Placed]
) -> None:
    """Colocated, the gate stands the one actor down and wakes it (handoff checks on: the wake's
    fingerprints are the trainer's); a resume on separate actors loads the checkpoint's weights
    into the engine replica before it serves (else the first refit's check would fail)."""
    first = run(tmp_path, "run.steps=2", "colocated=true", *SMALL)
    assert first.steps_done == 2
    assert placements[0].engine.replicas[0].actor is placements[0].trainer.ranks[0][0]
    records = read(tmp_path / "run" / "metrics.jsonl")
    assert all("timing/wake_s" in r and "timing/refit_s" not in r for r in records)
    resumed = run(tmp_path, "run.steps=3", *SMALL)
    assert (resumed.steps_done, resumed.policy_version) == (3, 3)
    assert placements[1].agreed == [True]


def test_colocated_on_ray_trains_what_in_process_trains_bit_for_bit(tmp_path: Path, ray_cluster: Any) -> None:
    """At L = 0 (nothing sampled depends on timing) the colocated actor's run logs the
    in-process run's rewards and losses exactly: each batch's completions and train groups
    cross the actor boundary unchanged and in order (`backends/ray/wire.py`)."""
    same = ["run.steps=3", "colocated=true", "async_rl.max_lookahead_versions=0", *SMALL]
    run(tmp_path / "ray", *same)
    local = [
        f"run.dir={tmp_path / 'local' / 'run'}",
        "run.progress=false",
        "run.plot=false",
        "model.threads=1",
    ]
    local_recipe = pipeline.load_recipe("recipes/quickstart.yaml", [*local, *same])
    anyio.run(lambda: shell_run.run_program(local_recipe))
    keys = ("reward/mean", "train/loss", "train/grad_norm", "train/token_mult_prob_error")
    on_ray, in_process = (read(tmp_path / side / "run" / "metrics.jsonl") for side in ("ray", "local"))
    assert [[r[k] for k in keys] for r in on_ray] == [[r[k] for k in keys] for r in in_process]
    assert len(on_ray) == 3


@pytest.mark.parametrize("during", ["batch", "refit"])
def test_weights_by_a_collective_broadcast_reach_both_replicas_and_a_restarted_one_rejoins(
    tmp_path: Path, placements: list[Placed], during: str
) -> None:
    """`placement.weights: collective` (gloo here): every refit is a broadcast in one group of
    the trainer and both replicas, and the gate's handoff check (on) compares fingerprints after
    each. Replica 0 is killed after step 2, while it holds requests (the new actor loads the
    trainer's kept buckets by package; the next refit builds a new group with it) or during the
    next refit (that refit starts again, in a new group)."""
    killed: list[threading.Event] = []

    def echo(record: dict[str, Any]) -> None:
        if record["step"] == 2:
            engine = placements[0].engine
            replica = engine.replicas[0]
            busy = (lambda: replica.in_flight > 0) if during == "batch" else (lambda: engine.announced == 3)
            killed.append(kill_when(busy, lambda: replica.where["pid"]))

    summary = run(
        tmp_path,
        "run.steps=5",
        "placement.engines=2",
        "placement.weights=collective",
        "placement.collective_timeout_s=10",  # at most this long stuck on the dead replica
        *SMALL,
        echo=echo,
    )
    [placed] = placements
    assert killed[0].is_set()
    assert summary.steps_done == 5
    assert summary.last_metrics["placement/engine_restarts"] == 1
    assert placed.engine.collective.builds == 2
    if during == "refit":  # (killed mid-batch, its death may also reach the refit first)
        assert placed.engine.collective.attempts == 1
    assert all(placed.agreed) and placed.engine.fingerprint() is not None  # every refit checked
    assert [len(groups) for groups in placed.trained] == [8] * 5
