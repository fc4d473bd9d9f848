"""engine=openai: any OpenAI-compatible server (vLLM, llama.cpp's server, SGLang, ...) by URL, streaming.

Each request is sent at its arrival time (a closed-loop follower when the one it follows finishes) on
its own connection, as a streaming /completions call with the prompt as token ids, greedy or sampled
as the workload asks, `ignore_eos` and `min_tokens` so that it generates exactly max_new_tokens as
ablate's arms do. Times are taken as vLLM's benchmark takes them: TTFT at the first chunk with text,
each later chunk an emission (ITL). The tokens are the chunks' `token_ids` where the server returns
them (vLLM with return_token_ids), else the text re-encoded with the model's tokenizer: then the
token agreement with ablate's greedy output is a tokenisation of text, and says so in its row.
"""
from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ablate.api.sequence import Request
from ablate.outside.contract import OutsideEngine, OutsideEngineConfig, OutsideEngineError, option
from ablate.outside.timeline import Timeline
from ablate.model.llama import LlamaModel
from ablate.workload.arrivals import ArrivalQueue


def stream_completion(url: str, body: dict[str, Any], timeout_s: float):
    """Yield the JSON chunks of a streaming completion (server-sent events), until [DONE]."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s) as response:
        for raw in response:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":
                return
            chunk = json.loads(payload)
            if "error" in chunk:            # a failure after the stream began: an event, not a status code
                error = chunk["error"]
                raise ValueError(f"the server reported: {error.get('message', error) if isinstance(error, dict) else error}")
            yield chunk


@dataclass
class OpenAIConfig(OutsideEngineConfig):
    name: str = "openai"
    url: str = option("", "the server's base URL, e.g. http://127.0.0.1:8000/v1")
    model: str = option("", "the model name the server serves; '': the first one /models lists")
    max_concurrency: int = option(0, "requests in flight at once; 0: each is sent at its arrival")
    timeout_s: float = option(600.0, "seconds a request may take")

    def __post_init__(self) -> None:
        if self.max_concurrency < 0:
            raise ValueError(f"max_concurrency must be >= 0 (0: each request sent at its arrival), got {self.max_concurrency}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


class OpenAICompatible(OutsideEngine):
    name = "openai"
    in_worker = False       # a client of a server, which runs (or crashes) in a process of its own
    config_class = OpenAIConfig

    def __init__(self, config: OutsideEngineConfig, model: LlamaModel, max_batch: int) -> None:
        """`config` an OpenAIConfig; a subclass that starts its own server (engine=vllm) passes its own
        config, with a timeout_s, and connects once the server is up."""
        super().__init__(config, model, max_batch)
        self.tokenizer = None
        self.re_encoded = False            # some outputs were text re-encoded, not the server's token ids
        self.timeout_s: float = config.timeout_s
        self.max_concurrency = 0           # every request sent at its arrival
        if isinstance(config, OpenAIConfig):
            if not config.url:
                raise ValueError("engine=openai needs url: the server's base URL, e.g. http://127.0.0.1:8000/v1")
            self.max_concurrency = config.max_concurrency
            self.connect(config.url, config.model)

    def connect(self, url: str, served_model: str = "") -> None:
        """Talk to the server at `url` (its base, .../v1), to `served_model` or the first it lists."""
        self.base = url.rstrip("/")
        self.served_model = served_model or self._first_model()

    def _first_model(self) -> str:
        try:
            with urllib.request.urlopen(f"{self.base}/models", timeout=30) as response:
                models = json.load(response)["data"]
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"engine=openai: cannot list the models of {self.base}/models: {err}") from err
        if not models:
            raise ValueError(f"engine=openai: {self.base}/models lists no model")
        return models[0]["id"]

    def describe(self) -> dict[str, str]:
        return {"precision": "the server's", "weights": f"{self.served_model} at {self.base}",
                "batching": "the server's", "tokens": "re-encoded text" if self.re_encoded else "the server's ids"}

    def body(self, request: Request) -> dict[str, Any]:
        s = request.sampling
        body = {"model": self.served_model, "prompt": list(request.prompt_token_ids), "stream": True,
                "max_tokens": request.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
                "return_token_ids": True}
        if not request.stop_token_ids:      # exactly max_new_tokens, as ablate's arms generate
            body |= {"ignore_eos": True, "min_tokens": request.max_new_tokens}
        if not s.is_greedy and s.seed is not None:
            body["seed"] = s.seed
        return body

    def _serve_one(self, request: Request, timeline: Timeline, t0: float) -> list[int]:
        ids: list[int] = []
        text: list[str] = []
        last = t0
        for chunk in stream_completion(f"{self.base}/completions", self.body(request), self.timeout_s):
            choices = chunk.get("choices") or []
            if not choices:
                continue                    # a usage-only chunk
            now = time.perf_counter()
            piece, token_ids = choices[0].get("text") or "", choices[0].get("token_ids")
            if token_ids:
                ids += token_ids
            text.append(piece)
            if piece or token_ids:
                timeline.emit(request.request_id, now, len(token_ids) if token_ids else 1)
                last = now
        if not ids and text:
            ids = self._encode("".join(text))
        out = ids[:request.max_new_tokens]
        for i, token in enumerate(out):
            if token in request.stop_token_ids:
                out = out[:i + 1]
                break
        timeline.finish(request.request_id, last, "stop" if out and out[-1] in request.stop_token_ids else "length")
        return out

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            from ablate.checkpoints.loader import load_tokenizer
            self.tokenizer = load_tokenizer(self.model.config)
        self.re_encoded = True
        return self.tokenizer.encode(text)

    def serve(self, requests: Sequence[Request], timeline: Timeline) -> dict[int, list[int]]:
        arrivals = ArrivalQueue(requests)
        done: queue.Queue[tuple[int, list[int] | BaseException, float]] = queue.Queue()
        outputs: dict[int, list[int]] = {}
        limit = self.max_concurrency or len(requests)
        waiting: list[tuple[float, Request]] = []
        in_flight = 0
        t0 = time.perf_counter()

        def work(request: Request) -> None:
            try:
                result: list[int] | BaseException = self._serve_one(request, timeline, t0)
            except (OSError, ValueError, urllib.error.URLError) as err:
                result = err
            done.put((request.request_id, result, time.perf_counter() - t0))

        while len(outputs) < len(requests):
            waiting += arrivals.due(time.perf_counter() - t0)
            while waiting and in_flight < limit:
                arrival, request = waiting.pop(0)
                timeline.arrive(request, t0 + arrival)
                timeline.scheduled(request.request_id, time.perf_counter())
                threading.Thread(target=work, args=(request,), daemon=True).start()
                in_flight += 1
            next_time = arrivals.next_time()      # wake for the next arrival, or (None) for the next finish
            wait = None if next_time is None else max(0.0, next_time - (time.perf_counter() - t0))
            try:
                request_id, result, finished = done.get(timeout=wait)
            except queue.Empty:
                continue
            in_flight -= 1
            if isinstance(result, BaseException):
                raise OutsideEngineError(f"engine={self.name}: request {request_id} to {self.base} failed: "
                                         f"{type(result).__name__}: {result}")
            outputs[request_id] = result
            arrivals.finished(request_id, finished)
        return outputs
