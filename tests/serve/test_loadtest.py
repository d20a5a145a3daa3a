"""The load test's closed loop against a local HTTP server (no Ray): which answers it counts, and what it reports;
the progress it shows while a level runs (on a terminal and in a log); the ``loadtest`` command's checks of its
options, and what it says where no service answers."""

from __future__ import annotations

import io
import json
import logging
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from optimum_iobinding.cli import main
from optimum_iobinding.serve import loadtest
from optimum_iobinding.serve.loadtest import LevelProgress, run_level, write_results
from tests.commands import error_line


class Service:
    """Answers POST /v1/images at once with the headers the serve app sends; request bodies are recorded. A prompt
    "bad" gets 400 (with the serve app's ``detail``), and so does a prompt "odd seeds fail" with an odd seed."""

    def __init__(self):
        self.bodies = []
        lock = threading.Lock()
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    service.bodies.append(body)
                refused = body["prompt"] == "bad" or (body["prompt"] == "odd seeds fail" and body["seed"] % 2)
                status = 400 if refused else 200
                self.send_response(status)
                for name, value in (
                    ("X-Batch-Images", "2"),
                    ("X-Pipeline-Seconds", "0.001"),
                    ("X-Replica-Seconds", "0.002"),
                    ("X-Server-Seconds", "0.003"),
                    ("X-Body-Seconds", "0.0004"),
                    ("X-Encode-Seconds", "0.0005"),
                ):
                    self.send_header(name, value)
                answer = json.dumps({"detail": "prompt: refused"}).encode() if refused else b"ok"
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

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
    assert (row["body_mean_s"], row["encode_mean_s"]) == (0.0004, 0.0005)


def test_refused_requests_are_reported_by_status_and_not_counted_as_images(service):
    row = run_level(service.url, 2, 4, {"prompt": "bad"}, warmup=0)
    assert row["ok"] == 0 and row["statuses"] == {"400": 4} and row["p50_s"] is None
    assert row["images_per_s"] == 0


def test_a_levels_errors_are_counted_by_their_kind_with_what_the_service_said(service):
    row = run_level(service.url, 1, 4, {"prompt": "odd seeds fail", "seed": 0}, warmup=0)
    assert row["error_counts"] == {"400": 2} and row["errors"] == ["400: prompt: refused"]


def test_requests_without_an_answer_are_counted_by_the_kind_of_their_failure(no_server):
    row = run_level(no_server, 1, 2, {"prompt": "a cat"}, warmup=0)
    assert row["error_counts"] == {"ConnectionRefusedError": 2} and row["errors"] == ["Connection refused"]


@pytest.mark.parametrize("arguments", [(0, 4, 0), (2, 0, 0), (2, 4, -1)])
def test_a_level_refuses_non_positive_counts(service, arguments):
    concurrency, requests, warmup = arguments
    with pytest.raises(ValueError, match="concurrency and requests"):
        run_level(service.url, concurrency, requests, {"prompt": "x"}, warmup=warmup)


# ------------------------------------------------------------------------------------------------- the progress
class Terminal(io.StringIO):
    """What a terminal shows, written as text: a stream whose ``isatty()`` is true."""

    def isatty(self):
        return True

    def frames(self):
        """The states of the line, in order: each redraw starts with a carriage return."""
        return [frame.strip() for frame in self.getvalue().split("\r") if frame.strip()]


def test_in_a_log_a_level_writes_one_line_when_it_ends(service):
    log = io.StringIO()
    row = run_level(service.url, 2, 6, {"prompt": "a cat"}, warmup=2, progress=log)
    assert log.getvalue() == f"concurrency 2: 8/8 requests, 0 errors, {row['images_per_s']:.2f} images/s\n"


def test_the_progress_counts_refused_requests_as_errors_warm_up_included(service):
    log = io.StringIO()  # one client: exactly the seeds 0 … 5 go out, and 1, 3 and 5 are refused
    row = run_level(service.url, 1, 4, {"prompt": "odd seeds fail", "seed": 0}, warmup=2, progress=log)
    assert row["statuses"] == {"200": 2, "400": 2}
    assert log.getvalue() == f"concurrency 1: 6/6 requests, 3 errors (400 ×3), {row['images_per_s']:.2f} images/s\n"


def test_the_progress_counts_requests_without_an_answer_as_errors_by_their_kind():
    log = io.StringIO()
    progress = LevelProgress(1, requests=3, warmup=0, images_per_request=1, stream=log, start=0.0)
    for when, kind in ((1.0, "503"), (2.0, "ConnectionResetError"), (3.0, "ConnectionResetError")):
        progress.add(ok=False, when=when, kind=kind)
    progress.close({"statuses": {"None": 2, "503": 1}, "images_per_s": 0.0})
    assert log.getvalue() == (
        "concurrency 1: 3/3 requests, 3 errors (ConnectionResetError ×2, 503 ×1), 0.00 images/s\n"
    )


def test_on_a_terminal_the_line_is_redrawn_in_place_with_the_answers_errors_and_images_per_second_so_far():
    terminal = Terminal()
    progress = LevelProgress(
        4, requests=2, warmup=1, images_per_request=2, stream=terminal, start=0.0, refresh_seconds=0
    )
    assert "concurrency 4: 0/3 requests" in terminal.frames()[-1]
    progress.add(ok=True, when=10.0)  # the warm-up's answer: the images/s start from here
    assert "concurrency 4: 1/3 requests" in terminal.frames()[-1] and "0 errors, — images/s" in terminal.frames()[-1]
    progress.add(ok=False, when=11.0, kind="400")
    assert "2/3 requests" in terminal.frames()[-1] and "1 error (400 ×1), 0.00 images/s" in terminal.frames()[-1]
    progress.add(ok=True, when=12.0)  # 2 images in the 2 s since the warm-up
    assert "3/3 requests" in terminal.frames()[-1] and "1 error (400 ×1), 1.00 images/s" in terminal.frames()[-1]
    progress.close({"statuses": {"200": 1, "400": 1}, "images_per_s": 0.9})  # the level's own figure at the end
    assert "3/3 requests" in terminal.frames()[-1] and "1 error (400 ×1), 0.90 images/s" in terminal.frames()[-1]
    assert terminal.getvalue().count("\n") == 1 and terminal.getvalue().endswith("\n")  # one line, left in place


def test_on_a_terminal_a_level_shows_its_line_while_it_runs(service):
    terminal = Terminal()
    row = run_level(service.url, 2, 4, {"prompt": "a cat"}, warmup=0, progress=terminal)
    assert terminal.frames()[0].startswith("concurrency 2: 0/4 requests")
    assert terminal.frames()[-1].startswith("concurrency 2: 4/4 requests")
    assert f"0 errors, {row['images_per_s']:.2f} images/s" in terminal.frames()[-1]


def test_the_command_writes_a_progress_line_per_level_on_stderr_and_the_table_on_stdout(service, capsys):
    assert main(["loadtest", service.url, "--concurrency", "1,2", "--requests", "2", "--warmup", "0"]) == 0
    output = capsys.readouterr()
    lines = output.err.splitlines()
    assert [line.split(",")[0:2] for line in lines] == [
        ["concurrency 1: 2/2 requests", " 0 errors"],
        ["concurrency 2: 2/2 requests", " 0 errors"],
    ]
    assert "| 1 | 2 (2) |" in output.out and "| 2 | 2 (2) |" in output.out and "requests," not in output.out


def test_the_report_counts_each_levels_errors_by_kind_and_says_what_they_were(service, capsys):
    argv = ["loadtest", service.url, "--concurrency", "1", "--requests", "2", "--warmup", "0", "--prompt", "bad"]
    assert main(argv) == 1
    output = capsys.readouterr()
    assert "| 1 | 2 (0) |" in output.out and output.out.splitlines()[2].endswith("| 400 ×2 |")
    assert "- concurrency 1: 400: prompt: refused" in output.out
    assert "2 errors (400 ×2)" in output.err


# --------------------------------------------------------------------------------------------------- the command
@pytest.fixture
def no_server():
    """The URL of a port nothing listens on: bound here (so nothing else takes it) and never listening."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as bound:
        bound.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{bound.getsockname()[1]}"


def test_loadtest_against_no_server_says_why_in_one_line_and_exits_1(no_server, tmp_path, capsys):
    assert main(["loadtest", no_server, "--concurrency", "1,2", "--requests", "2", "--out", str(tmp_path / "out")]) == 1
    assert error_line(capsys) == (
        f"optimum-iobinding: error: url: no service answered at {no_server}: Connection "
        "refused (is the server running?)"
    )
    assert capsys.readouterr().out == ""  # no empty table
    assert not (tmp_path / "out").exists()


def test_a_service_that_stops_answering_keeps_the_levels_measured_before(
    service, no_server, tmp_path, capsys, monkeypatch
):
    """The first level reaches the service, the second finds nothing there: the first is reported and written, then
    the command says why it stopped."""
    urls = iter([service.url, no_server])
    level = loadtest.run_level
    monkeypatch.setattr(loadtest, "run_level", lambda url, *args, **kwargs: level(next(urls), *args, **kwargs))
    assert main(["loadtest", service.url, "--concurrency", "1,2,4", "--requests", "2", "--out", str(tmp_path)]) == 1
    output = capsys.readouterr()
    assert "| 1 | 2 (2) |" in output.out
    assert "no service answered" in output.err and "Connection refused" in output.err
    rows = json.loads((tmp_path / "loadtest.json").read_text())["rows"]
    assert [(row["concurrency"], row["ok"]) for row in rows] == [(1, 2), (2, 0)]  # level 4 never ran


LOADTEST_MISTAKES = [
    (["--concurrency", "0,x"], "--concurrency: expected positive integers, comma-separated like 1,4,16, got '0,x'"),
    (["--concurrency", "1,0"], "--concurrency: expected positive integers, comma-separated like 1,4,16, got '1,0'"),
    (["--concurrency", ","], "--concurrency: expected positive integers, comma-separated like 1,4,16, got ','"),
    (["--requests", "0"], "--requests: expected a positive integer, got 0"),
    (["--warmup", "-2"], "--warmup: expected a count ≥ 0, or -1 for one per client thread, got -2"),
    (["--seed", "-1"], f"--seed: expected an integer in 0 … {2**63 - 1} (the service's seeds), got -1"),
    (["--steps", "0"], "--steps: expected a positive integer, got 0"),
    (["--guidance", "nan"], "--guidance: expected a finite number, got nan"),
    (["--size", "512x"], "--size: expected pixels as 512 or 768x512 (width x height), got '512x'"),
    (["--size", "0"], "--size: expected pixels as 512 or 768x512 (width x height), got '0'"),
    (["--timeout", "0"], "--timeout: expected seconds > 0, got 0.0"),
]


@pytest.mark.parametrize("argv, message", LOADTEST_MISTAKES, ids=[" ".join(argv) for argv, _ in LOADTEST_MISTAKES])
def test_every_option_error_names_the_option_before_any_request(service, capsys, argv, message):
    assert main(["loadtest", service.url, *argv]) == 2
    assert error_line(capsys) == f"optimum-iobinding: error: {message}"
    assert service.bodies == []


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://127.0.0.1:8000", "http://", "http://127.0.0.1:99999"])
def test_a_url_that_is_no_service_address_is_refused_before_any_request(capsys, url):
    assert main(["loadtest", url]) == 2
    assert (
        error_line(capsys) == f"optimum-iobinding: error: url: expected the service's address, like "
        f"http://127.0.0.1:8000, got {url!r}"
    )


def test_an_out_that_is_a_file_is_refused_before_any_request(service, tmp_path, capsys):
    (tmp_path / "results").write_text("mine")
    assert main(["loadtest", service.url, "--out", str(tmp_path / "results")]) == 2
    assert "--out: expected a folder, not a file, got" in error_line(capsys)
    assert service.bodies == [] and (tmp_path / "results").read_text() == "mine"


@pytest.mark.parametrize("size, sent", [("512", 512), ("768X512", "768x512")])
def test_the_size_is_sent_as_the_service_reads_it(service, size, sent):
    assert (
        main(["loadtest", service.url, "--concurrency", "1", "--requests", "1", "--warmup", "0", "--size", size]) == 0
    )
    assert [body["size"] for body in service.bodies] == [sent]


def test_the_load_test_speaks_the_services_seeds_and_sizes():
    schema = pytest.importorskip("optimum_iobinding.serve.schema")  # needs the serve extra (pydantic)
    assert loadtest.MAX_SEED == schema.MAX_SEED
    assert schema.parse_size(loadtest.request_size("512"), 64) == (512, 512)
    assert schema.parse_size(loadtest.request_size("768x512"), 64) == (768, 512)


# ----------------------------------------------------------------------------------------------------- the plot
def test_the_help_names_the_extra_the_plot_needs(capsys):
    with pytest.raises(SystemExit):
        main(["loadtest", "--help"])
    assert "optimum-iobinding[plot]" in " ".join(capsys.readouterr().out.split())


def test_without_matplotlib_the_plot_is_one_warning_naming_the_plot_extra(service, tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    rows = [run_level(service.url, 1, 2, {"prompt": "a cat"})]
    with caplog.at_level(logging.WARNING, logger=loadtest.__name__):
        written = write_results(tmp_path, rows, {"url": service.url, "command": "test", "date": "now"})
    assert [path.name for path in written] == ["loadtest.json", "loadtest.md"]
    assert [(record.levelname, record.getMessage()) for record in caplog.records] == [
        ("WARNING", "loadtest.png not drawn: matplotlib is not installed (pip install 'optimum-iobinding[plot]')")
    ]


def test_with_matplotlib_the_plot_is_written(service, tmp_path):
    pytest.importorskip("matplotlib")
    rows = [run_level(service.url, level, 2, {"prompt": "a cat"}) for level in (1, 2)]
    written = write_results(tmp_path, rows, {"url": service.url, "command": "test", "date": "now"})
    assert written[-1] == tmp_path / "loadtest.png" and written[-1].read_bytes().startswith(b"\x89PNG")
