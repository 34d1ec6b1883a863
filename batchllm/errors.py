"""The one exception root, so callers can catch everything batchllm raises on purpose."""


class BatchLLMError(Exception):
    """Root of every error batchllm raises deliberately."""


class InputError(BatchLLMError):
    """The input file cannot be used (unreadable, or refused under --strict)."""


class StorageError(BatchLLMError):
    """The job storage (BATCHLLM_STORAGE: a path, or a bucket) cannot be written or read."""


class JobNotFound(BatchLLMError):
    """No job with that id (or id prefix) exists."""


class EngineUnavailable(BatchLLMError):
    """vLLM is not installed or the engine could not start."""


class EngineSettingsError(EngineUnavailable):
    """An engine setting this machine cannot honour (more GPUs than it has, a quantization its
    GPUs cannot run): refused before the engine starts."""


class EngineMismatch(BatchLLMError):
    """A fleet worker's engine cannot run this job (another model kind, LoRA, a longer explicit
    context...): the job waits for a worker that can. `unmet` names each requirement."""

    def __init__(self, unmet: list[str]) -> None:
        super().__init__("this worker's engine cannot run the job: it needs " + "; ".join(unmet))
        self.unmet = unmet


class JobStateError(BatchLLMError):
    """The requested action does not fit the job's current state."""


class ShardBusy(BatchLLMError):
    """The shard is running on a live worker (its heartbeat is fresh)."""


class ShardLost(BatchLLMError):
    """This worker's lease on the shard ran out and another worker took it over."""


class EngineDied(BatchLLMError):
    """The engine process died or stopped mid-run: the rows in flight must run again."""


class JobInterrupted(BatchLLMError):
    """A local run was stopped by Ctrl-C: the job ended failed, its committed rows kept."""
