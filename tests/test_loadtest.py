"""The load test's closed loop against a local HTTP server (no Ray): which answers it counts, and what it reports."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from optimum_iobinding.serve.loadtest import run_level


class Service:
    """Answers POST /v1/images at once with the headers the serve app sends; request bodies are recorded. A prompt
    "bad" gets 400."""

    def __init__(self):
        self.bodies = []
        lock = threading.Lock()
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    service.bodies.append(body)
                status = 400 if body["prompt"] == "bad" else 200
                self.send_response(status)
                for name, value in (("X-Batch-Images", "2"), ("X-Pipeline-Seconds", "0.001"),
                                    ("X-Replica-Seconds", "0.002"), ("X-Server-Seconds", "0.003")):
                    self.send_header(name, value)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def service():
    service = Service()
    yield service
    service.close()


def test_a_level_counts_the_answers_after_the_warmup_and_keeps_sending_until_they_came(service):
    row = run_level(service.url, 4, 10, {"prompt": "a cat", "seed": 100}, warmup=4)
    assert row["concurrency"] == 4 and row["requests"] == 10 and row["warmup"] == 4
    assert row["ok"] == 10 and row["statuses"] == {"200": 10} and row["batch_images"] == {2: 10}
    # at least warmup + requests were sent, every one with its own seed; the clients stop once enough were answered
    seeds = [body["seed"] for body in service.bodies]
    assert 14 <= len(seeds) <= 14 + 3 and sorted(seeds) == list(range(100, 100 + len(seeds)))
    assert row["images_per_s"] > 0 and row["wall_s"] > 0
    assert 0 < row["p50_s"] <= row["p95_s"] <= row["p99_s"]
    assert (row["pipeline_mean_s"], row["replica_mean_s"], row["server_mean_s"]) == (0.001, 0.002, 0.003)


def test_refused_requests_are_reported_by_status_and_not_counted_as_images(service):
    row = run_level(service.url, 2, 4, {"prompt": "bad"}, warmup=0)
    assert row["ok"] == 0 and row["statuses"] == {"400": 4} and row["p50_s"] is None
    assert row["images_per_s"] == 0


@pytest.mark.parametrize("arguments", [(0, 4, 0), (2, 0, 0), (2, 4, -1)])
def test_a_level_refuses_non_positive_counts(service, arguments):
    concurrency, requests, warmup = arguments
    with pytest.raises(ValueError, match="concurrency and requests"):
        run_level(service.url, concurrency, requests, {"prompt": "x"}, warmup=warmup)
