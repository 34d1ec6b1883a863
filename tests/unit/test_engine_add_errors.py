"""How VllmEngine.add sorts what vLLM's add_request raises: a request vLLM refuses is that row's
error (RequestRejected); a failure because the EngineCore is gone is the engine's death
(EngineDied: the shard goes back and its rows run again), never an error row.

Found by the engine-kill fault test: between the EngineCore's death and the death watch's
notice, vLLM's monitor had closed the client's sockets, add_request raised zmq's "Socket
operation on non-socket", and the runner recorded it as row 408's error ("rejected by vLLM").
The client here is a stand-in for vLLM's LLMEngine: the subject is the sorting, not vLLM.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from batchllm.engine.vllm_engine import RequestRejected, VllmEngine
from batchllm.errors import EngineDied


class _Client:
    """add_request raises `error`; `dead` is what vLLM's monitor thread sets."""

    def __init__(self, error: Exception, *, dead: bool) -> None:
        self.error = error
        self.engine_core = SimpleNamespace(resources=SimpleNamespace(engine_dead=dead))
        self.aborted: list[str] = []

    def add_request(self, *_args, **_kwargs) -> None:
        raise self.error

    def abort_request(self, ids: list[str]) -> None:
        self.aborted += ids


def _engine(client: _Client) -> VllmEngine:
    engine = VllmEngine.__new__(VllmEngine)  # no vLLM engine built: add's sorting alone
    engine.engine = client
    engine.cross_encoder = None
    engine._lists, engine._top_k, engine._to_parse = {}, {}, {}
    return engine


def _zmq_error() -> Exception:
    import zmq

    return zmq.ZMQError(zmq.ENOTSOCK)


def test_a_socket_error_after_the_engine_died_is_its_death_not_the_rows_error() -> None:
    with pytest.raises(EngineDied, match="Socket operation on non-socket"):
        _engine(_Client(_zmq_error(), dead=True)).add("r1", [1, 2, 3], params=object())


def test_a_socket_error_before_the_monitor_noticed_is_the_engines_death_too() -> None:
    with pytest.raises(EngineDied):
        _engine(_Client(_zmq_error(), dead=False)).add("r1", [1, 2, 3], params=object())


def test_any_error_once_the_engine_is_dead_is_its_death() -> None:
    with pytest.raises(EngineDied):
        _engine(_Client(RuntimeError("closed"), dead=True)).add("r1", [1], params=object())


def test_a_request_vllm_refuses_is_that_rows_error_while_the_engine_lives() -> None:
    with pytest.raises(RequestRejected, match="too long"):
        _engine(_Client(ValueError("prompt too long"), dead=False)).add("r1", [1], params=object())


def test_another_error_of_a_live_engine_is_left_to_the_runner() -> None:
    # The runner records it as the row's error, as before (e.g. a parser this vLLM lacks).
    with pytest.raises(RuntimeError, match="odd"):
        _engine(_Client(RuntimeError("odd"), dead=False)).add("r1", [1], params=object())


class _Stepping:
    """A stand-in for vLLM's LLMEngine whose step raises `error`."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def step(self) -> list:
        raise self.error


def _stepping(error: Exception, *, in_process: bool) -> VllmEngine:
    engine = VllmEngine.__new__(VllmEngine)
    engine.engine = _Stepping(error)
    engine.in_process = in_process
    return engine


def test_an_error_in_an_engine_core_in_this_process_is_the_engines_death() -> None:
    """In process (VLLM_ENABLE_V1_MULTIPROCESSING=0) a failing model step raises as it is,
    where an engine core process would have died of it: the shard goes back either way."""
    with pytest.raises(EngineDied, match="RuntimeError: boom"):
        _stepping(RuntimeError("boom"), in_process=True).step()


def test_an_error_in_a_step_with_an_engine_core_process_is_not_taken_for_its_death() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        _stepping(RuntimeError("boom"), in_process=False).step()
