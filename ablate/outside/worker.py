"""An outside engine in a worker process of its own, kept for the experiment's rounds.

An engine that runs in the experiment's process (transformers, llama.cpp through llama-cpp-python)
takes the experiment with it when its native code crashes: llama-cpp-python 0.3.36 dies of SIGSEGV
right after loading on CPUs with AMX. In a worker the crash ends the worker only: its arm fails with
the signal named (OutsideEngineError) and the other arms are measured. The worker builds the engine
once (its loading is paid once, as before) and serves each round, timing the serving itself
(ablate.outside.serving), so the timeline holds the engine's work and not the messages.

The worker is a fresh interpreter (`python -m ablate.outside.worker`) talking over two pipes: not a
fork (torch's OpenMP threads have run in this process, and GNU OpenMP's pool does not survive a fork),
and not multiprocessing's spawn (inside a joblib sweep worker its start method is loky's, which a
fresh interpreter cannot set). It gets this process's sys.path first, so that an engine class this
process imports, it imports too. The experiment's model goes by value, its config and tensors pickled
(`portable`): the weights are copied once per engine (shared memory would move them into /dev/shm,
which containers keep small).
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from ablate.api.sequence import Request
from ablate.outside.contract import OutsideEngine, OutsideEngineConfig, OutsideEngineError
from ablate.outside.serving import Served, measured_serve
from ablate.exit_status import describe_exit
from ablate.model.config import ModelConfig
from ablate.model.llama import LlamaModel

CLOSE_TIMEOUT_S = 30.0      # for the engine's own close(); then the worker is killed


def _message(value: Any) -> bytes:
    """`value` pickled; an exception that does not pickle (it holds a handle) as a RuntimeError saying it."""
    try:
        return pickle.dumps(value)
    except Exception:              # noqa: BLE001  (any reason it cannot pickle)
        status, err = value
        return pickle.dumps((status, RuntimeError(f"{type(err).__name__}: {err}")))


def portable(model: LlamaModel) -> tuple[ModelConfig, dict[str, torch.Tensor], str]:
    """The model as its config, tensors and device: its layers also keep copies of their weights packed
    for this CPU's kernels, which do not pickle (and which the worker packs again if it runs them)."""
    return model.config, model.state_dict(), str(next(model.parameters()).device)


def rebuilt(config: ModelConfig, tensors: dict[str, torch.Tensor], device: str) -> LlamaModel:
    """`portable`'s model built again, in the worker."""
    model = LlamaModel.empty(config, device)
    model.load_state_dict(tensors)
    return model.finalize(device)


class EngineWorker:
    """The experiment's side: starts the worker, which builds the engine, and asks it to serve."""

    def __init__(self, cls: type[OutsideEngine], config: OutsideEngineConfig, model: LlamaModel, max_batch: int) -> None:
        self.name = cls.name
        worker_in, to_worker = os.pipe()
        from_worker, worker_out = os.pipe()
        self.process = subprocess.Popen([sys.executable, "-m", "ablate.outside.worker", str(worker_in), str(worker_out)],
                                        pass_fds=(worker_in, worker_out), stdin=subprocess.DEVNULL)
        os.close(worker_in)
        os.close(worker_out)
        self.requests = Connection(to_worker, readable=False)
        self.replies = Connection(from_worker, writable=False)
        try:
            self._ask(sys.path, "while starting", reply=False)
            self._ask(("start", (cls, config, portable(model), max_batch)), "while starting")
        except BaseException:
            self.close()
            raise

    def _ask(self, message: Any, when: str, reply: bool = True) -> Any:
        """Send `message`; its reply's value, or its error raised here; the worker's death, named."""
        try:
            self.requests.send_bytes(pickle.dumps(message))
            if not reply:
                return None
            status, value = pickle.loads(self.replies.recv_bytes())
        except (EOFError, OSError) as err:            # the worker is gone: how did it end?
            try:
                code = self.process.wait(CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise OutsideEngineError(f"engine={self.name}: its worker process stopped answering {when} "
                                         f"({type(err).__name__})") from None
            raise OutsideEngineError(f"engine={self.name}: its worker process ended {when}: {describe_exit(code)}") from None
        if status == "error":
            raise value
        return value

    def serve(self, requests: Sequence[Request], track_memory: bool) -> Served:
        return self._ask(("serve", (list(requests), track_memory)), "while serving")

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self._ask(("close", ()), "while closing")
                self.process.wait(CLOSE_TIMEOUT_S)
            except Exception:           # noqa: BLE001  (its close() failed, or it hangs: closed either way)
                self.process.kill()
                self.process.wait()
        self.requests.close()
        self.replies.close()


def serve_forever(requests: Connection, replies: Connection) -> None:
    """The worker's side: build the engine, serve each round, close it; a reply to every message."""
    sys.path[:] = pickle.loads(requests.recv_bytes())
    engine: OutsideEngine | None = None
    while True:
        try:
            message = requests.recv_bytes()
        except EOFError:                 # the experiment's process is gone
            break
        verb = "start"
        try:
            verb, args = pickle.loads(message)     # the engine's class imported here, the model rebuilt
            if verb == "start":
                cls, config, model, max_batch = args
                engine, value = cls(config, rebuilt(*model), max_batch), None
            elif verb == "serve":
                value = measured_serve(engine, *args)
            else:
                value = engine.close() if engine is not None else None
            reply = ("ok", value)
        except Exception as err:         # the engine's error, raised again in the experiment's process
            reply = ("error", err)
        try:
            replies.send_bytes(_message(reply))
        except OSError:                  # the experiment's process is gone
            break
        if verb == "close":
            break


if __name__ == "__main__":
    # Ctrl-C reaches the whole process group: the experiment's process decides, and closes this one
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve_forever(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
