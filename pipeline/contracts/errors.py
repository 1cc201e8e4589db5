"""The project's error types.

User mistakes (a bad recipe, a missing file) raise `PipelineError` subclasses whose message names
the field or file, the value and the fix; the CLI prints the message and exits non-zero without a
traceback. Everything else is a bug and keeps its traceback.
"""


class PipelineError(Exception):
    """An error the user can act on; its message is complete on its own."""

    exit_code = 1


class RecipeError(PipelineError):
    """The recipe (or a file it names) is invalid."""

    exit_code = 2


class DeadlineExceeded(PipelineError):
    """A deadline on the pipeline clock expired before the guarded work finished."""

    def __init__(self, what: str, seconds: float) -> None:
        super().__init__(f"{what} exceeded its deadline of {seconds:g} s")
        self.what = what
        self.seconds = seconds


class RequestRejected(PipelineError):
    """The engine refuses a request for what it asks (a prompt too long for the model, say):
    unlike a crash or a timeout, retrying it cannot help."""


class RetryableEngineError(Exception):
    """An engine's infrastructure failed (a worker crashed, a connection dropped, a fault was
    injected): the same request may succeed if retried. Engines raise it, or a subclass, for
    such failures; rollout and evaluation retry it within `rollout.max_retries`. Any other
    exception from an engine is a bug and fails the run with its traceback."""


class StallError(PipelineError):
    """The watchdog saw a stage make no progress for longer than `watchdog.stall_s`."""


class DropBudgetExceeded(PipelineError):
    """More work was dropped than the recipe allows."""


class HandoffMismatch(PipelineError):
    """After a stand-down, wake or refit the engine is not in the state the handoff promises:
    it serves weights other than the trainer's, or keeps memory it should have released."""


class BackendLost(PipelineError):
    """A part of the backend that holds training state is gone (its process died): nothing of
    it can be saved, so the run stops and its last committed checkpoint stays the newest."""


class NothingTrained(PipelineError):
    """The run cannot train: batches with nothing to train on, or steps that apply no update."""


class StageFailed(PipelineError):
    """A stage raised; the original error is the `__cause__`."""

    def __init__(self, stage: str, error: BaseException) -> None:
        super().__init__(f"stage {stage!r} failed: {type(error).__name__}: {error}")
        self.stage = stage
        self.error = error


class NonFiniteState(Exception):
    """What a `Checkpointable.save` raises for a state holding NaN or infinity, naming its file
    and where: such a state is never saved (the save fails, the committed checkpoints stay)."""


class DamagedState(Exception):
    """What a `Checkpointable.load` raises for its files missing, torn or not finite, naming the
    file and the problem: the checkpoint is damaged (an automatic resume tries the one before)."""
