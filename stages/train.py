"""Train: each whole batch's groups, with their GRPO advantages, trained in one step.

The batch assembler (`stages.batch_assembly`) hands out a batch once each of its
`prompts_per_step` prompts has arrived as a scored group or a drop; the step record
(`stages.step_record`) builds its metrics line. The step runs through the engine gate
(stand-down/train/[save]/wake when colocated, train/refit/[save] otherwise); only after it has
published the new weights does the batch's ticket go back, so generation never runs more than L
versions ahead. A batch with nothing trainable (all dropped, poisoned or unscored) trains
nothing, gives its ticket back and is counted; another batch takes its place. A run never ends
looking fine while it trains nothing: more than `max_consecutive_empty_batches` empty batches in
a row, more than `max_consecutive_skipped_steps` steps in a row whose optimizer updates were all
skipped (`train/applied_updates` 0), or a run whose every step was skipped, stops with
`NothingTrained`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Any, Literal

import msgspec

from pipeline.algorithms.config import Algorithm
from pipeline.contracts.errors import NothingTrained
from pipeline.contracts.messages import Dropped, Group, TrainGroup, TrainSample
from pipeline.contracts.protocols import Trainer
from pipeline.contracts.sections import (
    BackendName,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Section,
)
from pipeline.gate import EngineGate
from pipeline.startup import say
from pipeline.tickets import Ticket, TicketBox
from stages.batch_assembly import BatchAssembler
from stages.context import RunContext
from stages.evaluation import Evaluation, EvaluationSkipped
from stages.progress import Progress
from stages.step_record import StepRecorder

log = logging.getLogger("stages.train")


class TrainSection(Section, frozen=True):
    backend: BackendName = "torch"  # the trainer's (and engine's) compute: backends/registry.py
    lr: PositiveFloat = 3.0e-4
    weight_decay: NonNegativeFloat = 0.0
    beta1: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.999
    warmup_steps: NonNegativeInt = 0
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.1
    grad_clip: PositiveFloat = 1.0
    micro_batch_samples: PositiveInt = 256
    # Also cap a micro-batch's computed tokens (its prompts once each, plus its responses'
    # tokens: responses are packed at their own lengths, never padded); 0: no cap. A group
    # over the cap is split into runs of its samples, each computing the prompt again.
    micro_batch_tokens: NonNegativeInt = 0
    updates_per_step: PositiveInt = 1
    # The RL algorithm: a preset (pipeline/algorithms/presets.py), and each of its knobs, which
    # a recipe may set on its own (unset: the preset's). `advantage` and `policy_loss` also take
    # a `module:function` of your own.
    algorithm: Literal["grpo", "dr_grpo", "dapo", "gspo", "rloo"] = "grpo"
    advantage: str | None = None  # grpo | dr_grpo | rloo | module:function
    policy_loss: str | None = None  # token | sequence (GSPO) | module:function
    loss_aggregation: Literal["token_mean", "sequence_mean", "token_sum"] | None = None
    clip_low: NonNegativeFloat | None = None
    clip_high: NonNegativeFloat | None = None
    # DAPO's dynamic sampling: a group whose rewards are all equal (no advantage to learn from)
    # is filtered and another prompt generated for the same step in its place.
    dynamic_sampling: bool | None = None
    # With dynamic sampling each step admits prompts_per_step x oversample prompts (one ticket,
    # so within the lag bound) and trains the first prompts_per_step groups, in prompt order,
    # whose rewards are not all equal: the rest are counted (rollout/filtered_groups,
    # rollout/surplus_groups) and not trained. Fewer than prompts_per_step: the step trains those.
    oversample: Annotated[float, msgspec.Meta(ge=1)] = 2.0
    # DAPO's soft overlong penalty: over the last `overlong_buffer` tokens before
    # rollout.max_new_tokens (with an environment: rollout.max_episode_tokens) the reward falls
    # linearly by up to `overlong_penalty`.
    overlong_buffer: NonNegativeInt | None = None
    overlong_penalty: NonNegativeFloat = 1.0
    kl_coef: NonNegativeFloat = 0.0
    is_correction: Literal["none", "tis", "icepop"] = "tis"
    is_cap: Annotated[float, msgspec.Meta(gt=1)] = 2.0
    # bf16 models step float32 master copies (false: step the bf16 weights directly).
    master_weights: bool = True
    # Park master weights and optimizer moments in pinned host memory between steps (colocated:
    # room for the KV cache while the engine generates); costs two host-link copies per step.
    offload_optimizer: bool = False
    # torch.compile each layer's position-wise parts (norms, projections, SwiGLU) for training:
    # faster steps on GPU after a compile of tens of seconds in the first step.
    compile: bool = False
    # Recompute each layer in the backward pass instead of keeping its activations.
    activation_checkpointing: bool = False
    # Tensor-parallel ranks of the trainer (train.backend megatron, placement.backend ray: one
    # trainer actor a rank, each with placement.trainer_gpus).
    tensor_parallel: PositiveInt = 1
    # Data-parallel ranks of the trainer (placement.backend ray: one trainer actor a rank, with
    # train.tensor_parallel ranks each): every step's groups are split over them, whole groups
    # balanced by tokens, and they compute the update one rank would on all of them.
    data_parallel: PositiveInt = 1
    # Stop the run when this many batches in a row have nothing to train on (every group
    # dropped, poisoned or unscored), or this many steps in a row apply no optimizer update
    # (non-finite loss or gradient norm).
    max_consecutive_empty_batches: PositiveInt = 8
    max_consecutive_skipped_steps: PositiveInt = 8


# (step, next batch, the step's metrics record so far)
Saver = Callable[[int, int, dict[str, Any] | None], Awaitable[None]]


class TrainStage:
    """The step: trains each whole batch through the gate, gives its ticket back, writes its line.

    Batches come from the `BatchAssembler`, their lines from the `StepRecorder`; `save(step,
    next_batch, record)` runs inside the step where `save_due(step)` says (and at the last step);
    `check_saves()` before each step raises the failure of a checkpoint written in the
    background, which stops the run; `echo` and `on_eval` see each line written. A run resumed
    from a checkpoint whose step's evaluation was due and not recorded (a kill during it)
    evaluates first (`owed_eval`).
    """

    name = "train"

    def __init__(
        self,
        *,
        trainer: Trainer,
        gate: EngineGate,
        tickets: TicketBox,
        progress: Progress,
        batches: BatchAssembler,
        records: StepRecorder,
        context: RunContext,
        save: Saver,
        save_due: Callable[[int], bool],
        check_saves: Callable[[], None] = lambda: None,
        limits: TrainSection,
        algorithm: Algorithm,
        prompts_per_step: int,
        evaluation: Evaluation | None = None,
        echo: Callable[[dict[str, Any]], None] = lambda record: None,
        on_eval: Callable[[dict[str, Any]], None] = lambda record: None,
    ) -> None:
        self.trainer = trainer
        self.gate = gate
        self.tickets = tickets
        self.progress = progress
        self.batches = batches
        self.records = records
        self.context = context
        self.clock = context.clock
        self.save = save
        self.save_due = save_due
        self.check_saves = check_saves
        self.owed_eval = False
        self.algorithm = algorithm
        self.prompts_per_step = prompts_per_step
        self.max_empty_in_row = limits.max_consecutive_empty_batches
        self.max_skipped_in_row = limits.max_consecutive_skipped_steps
        self.evaluation = evaluation
        self.echo = echo
        self.on_eval = on_eval
        self.empty_in_row = 0
        self.skipped_in_row = 0
        self.steps_trained = 0  # this run's steps, and those of them that applied an update
        self.steps_applied = 0

    async def run(self) -> None:
        watchdog, trace = self.context.watchdog, self.context.trace
        try:
            if self.evaluation is not None and (self.progress.steps_done == 0 or self.owed_eval):
                if self.progress.steps_done == 0:
                    say("evaluating the starting weights on the held-out prompts")
                await self._evaluate(self.progress.steps_done)
            while True:
                waiting_since = self.clock.source.now()
                batch = self.batches.next_batch
                with watchdog.waiting(self.name, f"groups of batch {batch}"):
                    items = await self.batches.next()
                if items is None:
                    break
                now = self.clock.source.now()
                trace.span(f"wait batch {batch}", waiting_since, now, track="train")
                await self._step(batch, items, wait_s=now - waiting_since)
                self.batches.done()
            if self.progress.done and self.steps_trained and not self.steps_applied:
                raise NothingTrained(
                    f"all {self.steps_trained} train steps of this run skipped their optimizer "
                    "update (non-finite loss or gradient norm): nothing was trained"
                )
        finally:
            self.tickets.close()
            watchdog.done(self.name)

    async def _step(self, batch: int, items: list[Group | Dropped], *, wait_s: float) -> None:
        self.check_saves()
        groups = [item for item in items if isinstance(item, Group)]
        dropped = [item for item in items if isinstance(item, Dropped)]
        pairs = [(g, t) for g, t in ((g, train_group(g, self.algorithm)) for g in groups) if t.samples]
        record = self.records.rollout(batch, groups, dropped)
        if self.algorithm.dynamic_sampling:
            pairs, filtered, surplus = dynamic_sample(pairs, self.prompts_per_step)
            record.update({"rollout/filtered_groups": filtered, "rollout/surplus_groups": surplus})
        if not pairs:
            self._empty(batch, record)
            return
        train_groups = [t for _, t in pairs]
        self.empty_in_row = 0
        step = self.progress.steps_done + 1
        record.update(self.records.trained(step, [g for g, _ in pairs], self.gate.engine_version))

        async def train() -> Mapping[str, float]:
            result = await self.trainer.train_step(train_groups)
            record.update(result)
            return result

        async def save() -> None:
            # The checkpoint carries the step's record as known now, so a kill between the
            # save and the metrics line below cannot lose the line (resume writes it back).
            await self.save(step, batch + 1, {**record, "policy_version": self.gate.engine_version})

        saving = self.save_due(step) or step == self.progress.steps
        start = self.clock.source.now()
        with self.context.watchdog.waiting(self.name, f"train step {step}"):
            _, timings = await self.gate.step(train, save=save if saving else None)
        end = self.clock.source.now()
        self.context.trace.span(f"step {step}", start, end, track="train", batch=batch)
        # Weights are published: only now may the ticket admit another batch.
        self.tickets.give_back(Ticket(batch=batch))
        self.progress.batch_finished(trained=True)
        self.records.finish(
            record,
            end=end,
            gate=timings,
            wait_s=wait_s,
            policy_version=self.gate.engine_version,
            **{"train/empty_batches": self.progress.empty_batches},
        )
        self.echo(self.context.metrics.write(record))
        self._count_update(step, record)
        if self.evaluation is not None and self.evaluation.due(step, self.progress.steps):
            await self._evaluate(step)

    def _empty(self, batch: int, record: dict[str, Any]) -> None:
        """A batch with nothing to train on: not a train step, so no metrics line of its own
        (the next line's train/empty_batches and the *_total counters include it)."""
        self.tickets.give_back(Ticket(batch=batch))
        self.progress.batch_finished(trained=False)
        self.empty_in_row += 1
        if self.empty_in_row > self.max_empty_in_row:
            raise NothingTrained(
                f"{self.empty_in_row} batches in a row had nothing to train on (the last: "
                f"{record['rollout/dropped_groups']} groups dropped, "
                f"{record['rollout/poisoned_samples']} samples poisoned, "
                f"{record['rollout/unscored_samples']} unscored), over "
                f"train.max_consecutive_empty_batches={self.max_empty_in_row}"
            )
        log.warning(
            "batch %d had nothing to train on (%d groups dropped, %d samples poisoned); "
            "another batch takes its place",
            batch,
            record["rollout/dropped_groups"],
            record["rollout/poisoned_samples"],
        )

    def _count_update(self, step: int, record: dict[str, Any]) -> None:
        self.steps_trained += 1
        if record.get("train/applied_updates", 1) > 0:  # a trainer that does not say applied it
            self.steps_applied += 1
            self.skipped_in_row = 0
            return
        self.skipped_in_row += 1
        if self.skipped_in_row > self.max_skipped_in_row:
            raise NothingTrained(
                f"{self.skipped_in_row} train steps in a row (up to step {step}) skipped their "
                "optimizer update (non-finite loss or gradient norm), over "
                f"train.max_consecutive_skipped_steps={self.max_skipped_in_row}"
            )

    async def _evaluate(self, step: int) -> None:
        """Evaluate and write the record; an evaluation that cannot finish is skipped, said once."""
        assert self.evaluation is not None
        start = self.clock.source.now()
        try:
            result = await self.evaluation.run(self.gate)
        except EvaluationSkipped as skipped:
            log.warning("evaluation at step %d skipped: %s", step, skipped)
            return
        finally:
            end = self.clock.source.now()
            self.context.trace.span("eval", start, end, track="train")
            self.records.last_step_end = end  # evaluation time is not charged to the next step
        record = {
            "step": step,
            "policy_version": self.gate.engine_version,
            **result,
            "timing/eval_s": end - start,
        }
        self.on_eval(self.context.metrics.write_eval(record))


def train_group(group: Group, algorithm: Algorithm) -> TrainGroup:
    """What the trainer gets of a scored group: its prompt once, its usable samples with their
    advantages by the algorithm's estimator, over rewards shaped by its overlong penalty."""
    scored = [
        (s, s.reward + algorithm.overlong(len(s.tokens)))
        for s in group.samples
        if not s.poisoned and s.reward is not None
    ]
    advantages = algorithm.advantages()([reward for _, reward in scored])
    return TrainGroup(
        group_id=group.group_id,
        prompt_tokens=group.prompt.tokens,
        samples=tuple(
            TrainSample(
                tokens=s.tokens,
                logprobs=s.logprobs,
                reward=reward,
                advantage=advantage,
                loss_mask=s.loss_mask,
            )
            for (s, reward), advantage in zip(scored, advantages, strict=True)
        ),
    )


def dynamic_sample(
    pairs: list[tuple[Group, TrainGroup]], keep: int
) -> tuple[list[tuple[Group, TrainGroup]], int, int]:
    """DAPO's dynamic sampling over one batch's groups, in prompt order: the first `keep` whose
    rewards (as trained: shaped) are not all equal; (kept, filtered, surplus) counts."""
    spread = [pair for pair in pairs if len({s.reward for s in pair[1].samples}) > 1]
    return spread[:keep], len(pairs) - len(spread), max(0, len(spread) - keep)
