"""The parts of kept engines (batchllm/kept_engine/) that need no engine process: the keep-alive
durations, the registry of state files, the wire, the host's routing of two runs' requests
(driven in this process over socketpairs with the fake engine), the client's view of an engine
that is gone or refused it, and `engine start` and `run` naming the same engine for the same
flags. tests/integration/test_kept_engine.py runs the real processes."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pydantic
import pytest

from batchllm.engine.protocol import REJECTED, Finished
from batchllm.errors import BatchLLMError, EngineDied
from batchllm.execution.stand_in_engines import FakeEngine, InstantEngine
from batchllm.input.formats.rows import InputRow
from batchllm.kept_engine import control, registry, wire
from batchllm.kept_engine.client import KeptEngines, RemoteEngine
from batchllm.kept_engine.host import EngineHost
from batchllm.settings import Settings, duration_seconds
from batchllm.spec import JobSpec
from tests.support.cli import invoke

DEADLINE = 30.0

# -- durations -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("300", 300.0),
        ("90s", 90.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("1d", 86400.0),
        ("2.5m", 150.0),
        (" 5M ", 300.0),
        ("0", 0.0),
        ("0s", 0.0),
        ("-1", math.inf),
        ("-1m", math.inf),
    ],
)
def test_duration_seconds_reads_keep_alive_durations(text: str, seconds: float) -> None:
    assert duration_seconds(text) == seconds


@pytest.mark.parametrize("text", ["abc", "5x", "", "m", "5 minutes", "nan", "1ms"])
def test_duration_seconds_refuses_what_is_not_a_duration_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration") as refused:
        duration_seconds(text)
    assert repr(text) in str(refused.value)


def test_settings_refuse_a_keep_alive_that_is_not_a_duration(tmp_path: Path) -> None:
    with pytest.raises(pydantic.ValidationError, match="'nonsense' is not a duration"):
        Settings(home=tmp_path, keep_alive="nonsense")
    assert Settings(home=tmp_path, keep_alive="90s").keep_alive_seconds == 90.0
    assert Settings(home=tmp_path, keep_alive="-1").keep_alive_seconds == math.inf


def test_the_keep_alive_flag_refuses_what_is_not_a_duration(tmp_path: Path) -> None:
    result = invoke("engine", "start", "--model", str(tmp_path), "--keep-alive", "5x")
    assert result.exit_code == 2
    assert "'5x' is not a duration" in result.output
    result = invoke("engine", "start", "--model", str(tmp_path), "--keep-alive", "0")
    assert result.exit_code == 2
    assert "0 keeps no engine" in result.output


# -- the registry --------------------------------------------------------------------------------


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def record_of(home: Path, engine_id: str, *, pid: int, key: str = "k", **fields: Any):
    return registry.EngineRecord(
        id=engine_id,
        key=key,
        model="/models/m",
        kind="instant",
        pid=pid,
        uid=os.getuid(),
        socket=registry.socket_path(home, engine_id),
        started_at=time.time(),
        **fields,
    )


def test_list_records_forgets_a_dead_engine_and_removes_its_state_file_and_socket(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    dead = record_of(home, registry.new_engine_id(), pid=dead_pid(), state=registry.READY)
    live = record_of(home, "eng_0000a11e", pid=os.getpid(), keep_alive=math.inf)
    for record in (dead, live):
        registry.write_record(home, record)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bound:
        bound.bind(dead.socket)  # what a SIGKILLed engine leaves
    assert Path(dead.socket).is_socket()

    assert [r.id for r in registry.list_records(home)] == [live.id]

    assert not registry.state_path(home, dead.id).exists()
    assert not Path(dead.socket).exists()
    (kept,) = registry.list_records(home)
    assert kept.keep_alive == math.inf  # written as -1, read back as forever
    assert (kept.pid, kept.state) == (os.getpid(), registry.STARTING)


def test_read_record_skips_a_half_written_state_file(tmp_path: Path) -> None:
    folder = registry.engines_dir(tmp_path)
    (folder / "eng_0000half.json").write_text('{"id": "eng_0000ha')
    assert registry.read_record(folder / "eng_0000half.json") is None
    assert registry.list_records(tmp_path) == []


def test_a_socket_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a file of another user needs root (chown)")
    path = tmp_path / "theirs.sock"
    path.touch()
    os.chown(path, 65534, 65534)
    with pytest.raises(BatchLLMError, match="belongs to user id 65534"):
        registry.check_owned(path)
    registry.check_owned(tmp_path)  # its own folder passes


# -- the wire ------------------------------------------------------------------------------------


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        yield left, right


def test_wire_messages_go_through_whole_and_in_order(pair) -> None:
    left, right = pair
    finished = Finished("r1", "text", "length", 3, 4, logprobs=[{"token": "a", "logprob": -0.5}])
    big = ("step", [("r2", list(range(200_000)), 0, None)], 0.25)  # larger than a socket buffer

    def send_all() -> None:
        for message in (("ok", [finished]), big, ("hello", None)):
            wire.send(left, message)

    sender = threading.Thread(target=send_all)
    sender.start()
    assert wire.receive(right) == ("ok", [finished])
    assert wire.receive(right) == big
    assert wire.receive(right) == ("hello", None)
    sender.join(timeout=DEADLINE)


def test_wire_receive_raises_connection_closed_at_the_end_of_the_stream(pair) -> None:
    left, right = pair
    wire.send(left, ("status",))
    left.close()
    assert wire.receive(right) == ("status",)
    with pytest.raises(wire.ConnectionClosed):
        wire.receive(right)


def test_wire_receive_raises_connection_closed_when_a_message_is_cut_short(pair) -> None:
    left, right = pair
    left.sendall(wire._HEADER.pack(100) + b"only ten b")
    left.close()
    with pytest.raises(wire.ConnectionClosed):
        wire.receive(right)


def test_wire_refuses_a_header_no_batchllm_peer_sends(pair) -> None:
    left, right = pair
    left.sendall(b"GET / HTTP/1.1\r\n")
    with pytest.raises(wire.ConnectionClosed, match="not a batchllm peer"):
        wire.receive(right)


def test_peer_uid_names_the_user_at_the_other_end(pair) -> None:
    left, right = pair
    assert wire.peer_uid(left) == wire.peer_uid(right) == os.getuid()


# -- the host: two runs on one engine, over socketpairs -------------------------------------------


class RefusingEngine(FakeEngine):
    """Refuses, in `add`, every request whose id ends in `bad`. Each step first notes the
    engine's requests, and waits while `gate` is closed."""

    def __init__(self) -> None:
        super().__init__(steps=3, max_num_seqs=4, on_step=self._noted)
        self.gate = threading.Event()
        self.gate.set()
        self.at_steps: list[list[str]] = []

    def _noted(self, step: int) -> None:
        self.at_steps.append(sorted([*self.waiting, *self.running]))
        assert self.gate.wait(DEADLINE)

    def add(self, request_id: str, token_ids: Any, params: Any, adapter: Any = None) -> None:
        if request_id.endswith("bad"):
            raise ValueError(f"no room for {request_id.split(':', 1)[1]}")
        super().add(request_id, token_ids, params, adapter)


INFO = {
    "id": "eng_test",
    "pid": 0,
    "model": "fake",
    "kind": "fake",
    "max_model_len": 64,
    "max_num_seqs": 4,
    "version": "fake",
    "hardware": "fake",
}


class Hosted:
    """An EngineHost with its engine thread running, and runs connected to it over
    socketpairs (each served by the host's own connection code)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.host = EngineHost(engine, info=INFO, keep_alive=60.0, size=lambda job: 64)
        self.threads = [threading.Thread(target=self.host._engine_loop, daemon=True)]
        self.threads[0].start()
        self.runs: list[socket.socket] = []

    def connect(self) -> socket.socket:
        run, served = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        thread = threading.Thread(target=self.host._serve_connection, args=(served,), daemon=True)
        thread.start()
        self.threads.append(thread)
        self.runs.append(run)
        return run

    def close(self) -> None:
        for run in self.runs:
            run.close()
        self.host.stopping.set()
        for thread in self.threads:
            thread.join(timeout=DEADLINE)


@pytest.fixture
def hosted() -> Iterator[Hosted]:
    hosted = Hosted(RefusingEngine())
    try:
        yield hosted
    finally:
        hosted.close()


def call(run: socket.socket, op: str, *args: Any) -> Any:
    wire.send(run, (op, *args))
    status, value = wire.receive(run)
    assert status == "ok", (status, value)
    return value


def prompt_ids(run: socket.socket, *prompts: str) -> list[list[int]]:
    rows = [
        InputRow(line=i, custom_id=f"l{i}", kind="prompt", prompt=p) for i, p in enumerate(prompts)
    ]
    return call(run, "prepare", rows, None)


def collect(run: socket.socket, adds: list, expected: int) -> list[Finished]:
    """Send `adds` with the first step, then step until `expected` requests came back."""
    got: list[Finished] = []
    deadline = time.monotonic() + DEADLINE
    while len(got) < expected:
        assert time.monotonic() < deadline, f"only {len(got)} of {expected} came back"
        got += call(run, "step", adds, 0.05)
        adds = []
    return got


def test_two_runs_with_the_same_request_ids_each_get_back_only_their_own(hosted: Hosted) -> None:
    first, second = hosted.connect(), hosted.connect()
    assert call(first, "hello", None)["id"] == "eng_test"
    assert call(second, "hello", None)["id"] == "eng_test"
    adds: dict[socket.socket, list] = {}
    for run, who in ((first, "alpha"), (second, "beta")):
        handle = call(run, "sampling", {"max_tokens": 2 if who == "alpha" else 5})
        ids = prompt_ids(run, f"{who} one", f"{who} two")
        adds[run] = [(f"r{i}", tokens, handle, None) for i, tokens in enumerate(ids)]
    assert hosted.host.status()["runs"] == 2
    # Both runs' requests go into the engine at once, under the same ids: the engine thread
    # is held by a command until both are queued behind it.
    release = threading.Event()
    hosted.host._post(lambda: release.wait(DEADLINE))
    for run in (first, second):
        assert call(run, "step", adds[run], 0.0) == []
    release.set()
    got = {run: collect(run, [], 2) for run in (first, second)}
    names = hosted.engine.at_steps[0]
    assert len(names) == 4 and {n.split(":", 1)[1] for n in names} == {"r0", "r1"}, names
    assert len({n.split(":", 1)[0] for n in names}) == 2, names

    for run, who, tokens in ((first, "alpha", 2), (second, "beta", 5)):
        by_id = {out.request_id: out for out in got[run]}
        assert sorted(by_id) == ["r0", "r1"]  # the run's own ids, not the engine's names
        assert by_id["r0"].text == f"echo {who} one"
        assert by_id["r1"].text == f"echo {who} two"
        assert {out.completion_tokens for out in got[run]} == {tokens}
    assert hosted.host.status()["in_flight"] == 0
    # Nothing more comes to either run.
    assert call(first, "step", [], 0.05) == [] and call(second, "step", [], 0.05) == []


def test_a_request_the_engine_refuses_in_add_comes_back_rejected_to_its_run(
    hosted: Hosted,
) -> None:
    run, other = hosted.connect(), hosted.connect()
    handle = call(run, "sampling", {"max_tokens": 3})
    (ids,) = prompt_ids(run, "some words")
    got = collect(run, [("good", ids, handle, None), ("bad", ids, handle, None)], 2)

    by_id = {out.request_id: out for out in got}
    assert by_id["good"].finish_reason == "length"
    rejected = by_id["bad"]
    assert rejected.finish_reason == REJECTED
    assert rejected.text == "no room for bad"
    assert rejected.prompt_tokens == len(ids) and rejected.completion_tokens == 0
    assert call(other, "step", [], 0.05) == []  # the other run gets nothing of it


def test_a_run_that_leaves_has_its_requests_aborted(hosted: Hosted) -> None:
    run = hosted.connect()
    handle = call(run, "sampling", {"max_tokens": 3})
    (ids,) = prompt_ids(run, "left behind")
    many = [(f"r{i}", ids, handle, None) for i in range(12)]
    hosted.engine.gate.clear()  # the engine's first step waits
    call(run, "step", many, 0.0)
    wait_until(lambda: hosted.host.status()["in_flight"] == 12, "its requests in the engine")
    run.close()
    wait_until(lambda: hosted.host.status()["runs"] == 0, "the run to be gone")
    hosted.engine.gate.set()
    wait_until(lambda: not hosted.engine.has_unfinished(), "its requests aborted")
    assert hosted.host.status()["in_flight"] == 0
    assert len(hosted.engine.aborted) == 12, hosted.engine.aborted


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {DEADLINE} s"
        time.sleep(0.01)


def test_the_host_refuses_a_peer_of_another_user(
    hosted: Hosted, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wire, "peer_uid", lambda sock: os.getuid() + 1)
    run = hosted.connect()
    status, why = wire.receive(run)  # before the run says anything
    assert status == "refused"
    assert why == f"this kept engine serves user id {os.getuid()} only, not {os.getuid() + 1}"
    with pytest.raises(wire.ConnectionClosed):
        wire.receive(run)
    assert hosted.host.runs_served == 0 and hosted.host.status()["runs"] == 0


# -- the client ----------------------------------------------------------------------------------


@pytest.fixture
def served(
    settings: Settings, tiny_model: Path
) -> Iterator[tuple[EngineHost, registry.EngineRecord]]:
    """A kept instant engine's host serving in this process on a real socket in the home, with
    the state file a kept engine writes (its pid: this process's)."""
    from batchllm.engine.sizing import light_tokenizer

    engines = KeptEngines(settings, keep_alive=300.0, kind="instant")
    spec = JobSpec(model=str(tiny_model))
    record = record_of(
        settings.home,
        registry.new_engine_id(),  # a long home's socket is in a folder homes share
        pid=os.getpid(),
        key=engines.key(spec),
        state=registry.READY,
        max_model_len=512,
    )
    record.model = str(tiny_model)
    engine = InstantEngine(tokenizer=light_tokenizer(str(tiny_model)), max_model_len=512)
    info = {**INFO, "id": record.id, "max_model_len": 512, "max_num_seqs": 256}
    host = EngineHost(engine, info=info, keep_alive=300.0, size=lambda job: 64)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(record.socket)
    listener.listen(4)
    registry.write_record(settings.home, record)
    thread = threading.Thread(target=host.serve, args=(listener,), daemon=True)
    thread.start()
    try:
        yield host, record
    finally:
        host.stopping.set()
        thread.join(timeout=DEADLINE)
        listener.close()
        Path(record.socket).unlink()
        registry.remove_record(settings.home, record.id)


def test_a_run_that_finds_its_engine_warm_says_it_uses_it(
    settings: Settings, served, tiny_model: Path
) -> None:
    host, record = served
    said: list[str] = []
    engines = KeptEngines(settings, keep_alive=300.0, kind="instant", on_status=said.append)
    spec = JobSpec(model=str(tiny_model))
    warm = engines.warm(spec)  # a job is sized on it first (its context not known yet)
    assert warm is not None and warm.id == record.id
    assert engines.get(spec, 100) is warm
    assert engines.get(spec, 200) is warm
    engines.close()
    assert len(said) == 1 and said[0].startswith(f"using the kept engine {record.id} "), said
    assert host.runs_served == 1


def test_a_kept_engine_whose_socket_is_gone_is_passed_over(
    settings: Settings, tiny_model: Path
) -> None:
    """Its process still runs (it is unloading, or its socket was removed): a run goes on
    without it, and `engine status` says it cannot be reached."""
    engines = KeptEngines(settings, keep_alive=0.0, kind="instant")
    spec = JobSpec(model=str(tiny_model))
    record = record_of(
        settings.home,
        registry.new_engine_id(),
        pid=os.getpid(),
        key=engines.key(spec),
        state=registry.READY,
    )
    record.max_model_len = 4096
    registry.write_record(settings.home, record)
    try:
        assert engines.warm(spec) is None
        with pytest.raises(EngineDied, match=r"cannot be reached: .*\.sock is gone"):
            RemoteEngine(record, keep_alive=None)
        # keep-alive 0: with the kept engine out of reach, the run builds its own.
        engine = engines.get(spec, 512)
        assert isinstance(engine, InstantEngine)
        engines.close()
        (row,) = control.engine_statuses(settings.home)
        assert row["id"] == record.id and row["state"].startswith("unreachable ("), row
    finally:
        registry.remove_record(settings.home, record.id)


def test_a_refused_hello_is_an_error_of_the_run(settings: Settings, served, monkeypatch) -> None:
    _, record = served
    monkeypatch.setattr(wire, "peer_uid", lambda sock: os.getuid() + 1)
    with pytest.raises(BatchLLMError, match=f"serves user id {os.getuid()} only"):
        RemoteEngine(record, keep_alive=None)


# -- `engine start` and `run` name the same engine ----------------------------------------------


class _Found(Exception):
    pass


@pytest.fixture
def keys(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The engine keys KeptEngines looks for; the lookup then stops the command."""
    found: list[str] = []

    def find_or_start(self, spec, key, max_model_len):
        found.append(key)
        raise _Found(key)

    monkeypatch.setattr(KeptEngines, "_find_or_start", find_or_start)
    # `run` would load vLLM ahead in a spare engine process first (Spare): not the subject.
    monkeypatch.setattr(KeptEngines, "prestart", lambda self, spec: None)
    return found


@pytest.mark.parametrize(
    "flags",
    [
        (),
        ("--enforce-eager", "--max-model-len", "256"),
        ("--max-num-seqs", "8", "--max-num-batched-tokens", "512"),
        ("--dtype", "float32", "--no-prefix-caching"),
        ("--gpu-memory-utilization", "0.5", "--kv-cache-memory-bytes", "1000000000"),
        ("--compact-json", "--prefix-caching"),
        ("--engine", "instant", "--instant-step-seconds", "0.5"),
    ],
    ids=lambda flags: " ".join(flags) or "defaults",
)
def test_engine_start_and_run_with_the_same_flags_look_for_the_same_engine(
    settings, keys, tiny_model: Path, prompts: Path, flags: tuple[str, ...]
) -> None:
    model = ("--model", str(tiny_model))
    started = invoke("engine", "start", *model, *flags, "--keep-alive", "5m")
    assert isinstance(started.exception, _Found), started.output
    ran = invoke("run", str(prompts), *model, *flags, "--keep-alive", "5m", "--temperature", "0")
    assert len(keys) == 2, ran.output
    assert keys[0] == keys[1]


def test_engine_start_with_lora_and_a_run_with_an_adapter_look_for_the_same_engine(
    settings, keys, tiny_model: Path, prompts: Path, tmp_path: Path
) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        '{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "peft_type": "LORA"}'
    )
    model = ("--model", str(tiny_model))
    invoke("engine", "start", *model, "--enable-lora", "--keep-alive", "5m")
    ran = invoke("run", str(prompts), *model, "--lora", f"a={adapter}", "--keep-alive", "5m")
    assert len(keys) == 2, ran.output
    assert keys[0] == keys[1]
