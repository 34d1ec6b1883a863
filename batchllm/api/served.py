"""Which models this deployment serves, as `POST /v1/batches` refuses others (OpenAI's
`model_not_found`) and `GET /v1/models` lists them.

A model is served when the operator says so (BATCHLLM_SERVED_MODELS, or `serve --worker
MODEL`), when a live worker serves it, or when a worker served it within
BATCHLLM_SERVED_MODEL_RETENTION_SECONDS (the registry remembers when each model was last
announced): a fleet scaled to zero still takes batches for its models, which wait for a worker.
Anything else, a look-alike of a served name included, would wait `in_progress` on a queue no
worker reads until it expired: it is refused at create instead, and the message names the
models served and how an operator adds one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from batchllm.api.errors import ApiError
from batchllm.settings import Settings
from batchllm.worker import registry

_NAMED = 20  # models a refusal names: enough to spot a typo, short enough to read


@dataclass(frozen=True)
class ServedModels:
    """Where the served list comes from: `own` are the models of `serve --worker`; `live_only`
    (`serve --require-served-model`) counts no worker gone since, whatever the retention."""

    settings: Settings
    own: Sequence[str] = ()
    live_only: bool = False

    def configured(self) -> set[str]:
        return {*(self.settings.served_models or ()), *self.own}

    def names(self) -> set[str]:
        """Every model served: configured, a live worker's, or recently a worker's."""
        broker = self.settings.broker_url
        retention = 0.0 if self.live_only else self.settings.served_model_retention_seconds
        from redis.exceptions import RedisError  # redis-py is imported when first needed

        try:
            live = registry.served_models(broker)
            remembered = registry.recently_served(broker, retention)
        except RedisError as exc:
            raise ApiError(
                503,
                f"the worker registry (the broker) is unreachable: {type(exc).__name__}; try again",
                code="service_unavailable",
            ) from None
        return self.configured() | set(live) | set(remembered)

    def refusal(self, model: str) -> str | None:
        """Why a batch for `model` (compared exactly) is refused, or None when it is served."""
        if model in self.configured():  # no round trip to the broker
            return None
        served = self.names()
        if model in served:
            return None
        fix = (
            f"an operator accepts it before its workers start with "
            f"BATCHLLM_SERVED_MODELS='[\"{model}\"]' on the server, or starts one: "
            f"batchllm worker --model {model}"
        )
        if not served:
            return (
                f"model {model!r} is not served here: {self._no_worker()} and "
                f"BATCHLLM_SERVED_MODELS is unset ({fix})"
            )
        names = ", ".join(repr(name) for name in sorted(served)[:_NAMED])
        more = f" and {len(served) - _NAMED} more" if len(served) > _NAMED else ""
        return f"model {model!r} is not served here; served: {names}{more} ({fix})"

    def _no_worker(self) -> str:
        retention = self.settings.served_model_retention_seconds
        if self.live_only or retention <= 0:
            return "no live worker serves a model"
        return f"no worker has served a model in the last {_duration(retention)}"


def _duration(seconds: float) -> str:
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= size:
            return f"{seconds / size:g} {unit}"
    return f"{seconds:g} seconds"
