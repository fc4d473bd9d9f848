"""engine=openai against a small OpenAI-compatible server started here on loopback: what a streaming
client must get right (arrivals, concurrency, timing per chunk, the server's token ids or re-encoded
text, failures) is tested on a server whose answers are known."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ablate.api.sequence import Request
from ablate.outside.contract import OutsideEngineError
from ablate.outside.openai import OpenAICompatible
from ablate.outside.timeline import Timeline
from ablate.measure.metrics import summarise
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel

CHUNK_DELAY_S = 0.01


def answer(prompt: list[int], n: int) -> list[int]:
    """The fake model: token i of the answer to `prompt`."""
    return [(sum(prompt) + 7 * i) % 200 for i in range(n)]


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, send_ids: bool = True, fail: bool = False, fail_mid_stream: bool = False) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.send_ids, self.fail, self.fail_mid_stream = send_ids, fail, fail_mid_stream
        self.bodies: list[dict] = []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._json({"data": [{"id": "fake-model"}]})

    def _json(self, obj: dict, status: int = 200) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        server: FakeServer = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if server.fail:
            return self._json({"error": "model not loaded"}, status=500)
        with server.lock:
            server.bodies.append(body)
            server.in_flight += 1
            server.most_in_flight = max(server.most_in_flight, server.in_flight)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i, token in enumerate(answer(body["prompt"], body["max_tokens"])):
            time.sleep(CHUNK_DELAY_S)
            if server.fail_mid_stream and i == 2:
                self.wfile.write(b'data: {"error": {"message": "EngineCore died", "code": 500}}\n\n')
                break
            choice = {"text": f" t{token}"} | ({"token_ids": [token]} if server.send_ids else {})
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
        with server.lock:
            server.in_flight -= 1


@pytest.fixture
def server_factory():
    servers = []

    def start(**kwargs) -> FakeServer:
        server = FakeServer(**kwargs)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()


def engine(url: str, **options) -> OpenAICompatible:
    model = LlamaModel.random(preset("tiny"))
    return OpenAICompatible(OpenAICompatible.resolve_options("test", {"url": url, **options}), model, 4)


def requests(n: int = 3, new: int = 5, **kwargs) -> list[Request]:
    return [Request(i, (3 + i, 9, 4), new, **kwargs) for i in range(n)]


def test_streams_every_request_at_once_with_the_servers_tokens_and_times(server_factory):
    server = server_factory()
    client = engine(server.url)
    timeline = Timeline()
    out = client.serve(requests(), timeline)
    assert out == {i: answer([3 + i, 9, 4], 5) for i in range(3)}
    assert client.served_model == "fake-model" and server.most_in_flight == 3
    body = server.bodies[0]
    assert body["stream"] and body["max_tokens"] == body["min_tokens"] == 5 and body["ignore_eos"]
    assert body["temperature"] == 0 and isinstance(body["prompt"], list)
    for record in timeline.requests.values():
        times = [t for t, _ in record.emissions]
        assert record.arrival <= record.first_scheduled <= times[0] and times == sorted(times)
        assert record.num_output_tokens == 5 and record.finish == times[-1]
    figures = summarise(timeline)
    assert figures["ttft_p50_ms"] >= 1e3 * CHUNK_DELAY_S and figures["itl_p50_ms"] >= 0.5e3 * CHUNK_DELAY_S


def test_max_concurrency_queues_the_rest_and_late_arrivals_wait(server_factory):
    server = server_factory()
    timeline = Timeline()
    late = [Request(0, (1, 2), 3), Request(1, (2, 3), 3), Request(2, (5, 6), 3, arrival_time=0.2)]
    engine(server.url, max_concurrency=1).serve(late, timeline)
    assert server.most_in_flight == 1
    starts = {i: r.first_scheduled for i, r in timeline.requests.items()}
    assert starts[1] >= timeline.requests[0].finish - 0.005        # waited for the one in flight
    assert starts[2] - min(r.arrival for r in timeline.requests.values()) >= 0.2


def test_a_closed_loop_follower_is_sent_after_the_request_it_follows(server_factory):
    server = server_factory()
    timeline = Timeline()
    chain = [Request(0, (1, 2), 4), Request(1, (2, 3), 4, follows=0, arrival_time=0.05)]
    engine(server.url).serve(chain, timeline)
    assert timeline.requests[1].arrival >= timeline.requests[0].finish + 0.05 - 1e-3


def test_text_is_re_encoded_when_the_server_sends_no_token_ids(server_factory):
    class Words:
        def encode(self, text: str) -> list[int]:
            return [int(word[1:]) for word in text.split()]

    client = engine(server_factory(send_ids=False).url)
    client.tokenizer = Words()
    out = client.serve(requests(1), Timeline())
    assert out[0] == answer([3, 9, 4], 5) and client.describe()["tokens"] == "re-encoded text"


def test_a_stop_token_cuts_the_output_and_the_body_lets_the_server_stop(server_factory):
    server = server_factory()
    stop = answer([3, 9, 4], 5)[2]
    timeline = Timeline()
    out = engine(server.url).serve([Request(0, (3, 9, 4), 5, stop_token_ids=(stop,))], timeline)
    assert out[0] == answer([3, 9, 4], 5)[:3] and timeline.requests[0].finish_reason == "stop"
    assert "ignore_eos" not in server.bodies[0]


def test_server_errors_and_a_missing_url_are_named(server_factory):
    with pytest.raises(OutsideEngineError, match=r"request \d to http://127.0.0.1:\d+/v1 failed: HTTPError"):
        engine(server_factory(fail=True).url, model="m").serve(requests(1), Timeline())
    with pytest.raises(OutsideEngineError, match="failed: ValueError: the server reported: EngineCore died"):
        engine(server_factory(fail_mid_stream=True).url).serve(requests(1), Timeline())
    with pytest.raises(ValueError, match="engine=openai needs url"):
        engine("")
    with pytest.raises(ValueError, match="cannot list the models of http://127.0.0.1:9/v1/models"):
        engine("http://127.0.0.1:9/v1")
