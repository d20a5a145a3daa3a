"""Starting a server, without starting Ray: a port something listens on is refused before Ray starts (by the
command line with exit status 2 and one line naming host and port, by the Python API naming ``port``); the
readiness comes only once ``GET /health`` answers; a start that fails is one line saying what failed and what to do;
a replica names the model as it was given (``model``); and an image field that is no image is refused naming the
field, never with an object's repr."""

from __future__ import annotations

import base64
import errno
import http.server
import io
import itertools
import shutil
import signal
import socket
import sys
import threading

import pytest

from optimum_iobinding.errors import ArgumentError
from optimum_iobinding.serve.config import (
    ServeConfig,
    ServeStartError,
    check_port_free,
    local_url,
    wait_until_answering,
)

LINUX = sys.platform.startswith("linux")


def listening_socket(host: str = "127.0.0.1", reuse_port: bool = False) -> socket.socket:
    """A socket listening on a free port of ``host``; with ``reuse_port`` bound as Serve's proxy binds its port
    (``SO_REUSEADDR`` and ``SO_REUSEPORT``)."""
    sock = socket.socket()
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, 0))
    sock.listen()
    return sock


# ------------------------------------------------------------------------------------------------ the port check
@pytest.mark.parametrize(
    "reuse_port",
    [False, pytest.param(True, marks=pytest.mark.skipif(not LINUX, reason="SO_REUSEPORT as Linux has it"))],
    ids=["plain", "as-serves-proxy"],
)
@pytest.mark.parametrize(
    "holder_host, asked_host", [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"), ("127.0.0.1", "0.0.0.0")]
)
def test_a_port_something_listens_on_is_refused_naming_host_and_port(reuse_port, holder_host, asked_host):
    with listening_socket(holder_host, reuse_port) as holder:
        port = holder.getsockname()[1]
        with pytest.raises(ArgumentError) as refused:
            check_port_free(asked_host, port)
    assert refused.value.argument == "port" and f"{asked_host}:{port}" in str(refused.value)


def test_a_second_socket_with_so_reuseport_would_share_the_port_the_check_refuses():
    """Why the check binds without SO_REUSEPORT: a second server binding as Serve's proxy does is not refused by the
    kernel (the two would share the port, each connection going to either)."""
    if not LINUX:
        pytest.skip("SO_REUSEPORT as Linux has it")
    with listening_socket(reuse_port=True) as first, listening_socket(reuse_port=True) as _:
        port = first.getsockname()[1]
        with socket.socket() as second:
            second.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            second.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            second.bind(("127.0.0.1", port))  # shared, silently
        with pytest.raises(ArgumentError, match="port: expected a free port"):
            check_port_free("127.0.0.1", port)


@pytest.mark.skipif(not LINUX, reason="SO_REUSEADDR as Linux has it")
def test_a_port_left_in_time_wait_by_a_stopped_server_is_free():
    """A server that stopped leaves its closed connections in TIME_WAIT for a minute; a server started again at once
    on its port must not be refused."""
    server = listening_socket(reuse_port=True)
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server's side closes first: its end waits in TIME_WAIT
    client.recv(1)
    client.close()
    server.close()
    with socket.socket() as plain:  # the connection is still there: a plain bind fails
        with pytest.raises(OSError) as in_use:
            plain.bind(("127.0.0.1", port))
    assert in_use.value.errno == errno.EADDRINUSE
    check_port_free("127.0.0.1", port)


def test_a_host_that_is_no_address_of_this_machine_is_refused_naming_host():
    with pytest.raises(ArgumentError) as refused:
        check_port_free("no-such-host.invalid", 8000)
    assert refused.value.argument == "host" and "'no-such-host.invalid'" in str(refused.value)


def test_local_url_reaches_an_any_address_on_loopback():
    assert local_url("0.0.0.0", 80) == "http://127.0.0.1:80"
    assert local_url("::", 80) == "http://[::1]:80" and local_url("::1", 81) == "http://[::1]:81"
    assert local_url("localhost", 8000) == "http://localhost:8000"


@pytest.fixture
def no_server_start(monkeypatch):
    """The command's ``run``, replaced: a check that fails to refuse must not start a server (the test fails)."""
    import optimum_iobinding.serve as serving

    def started(*args, **kwargs):
        raise AssertionError("the server was started")

    monkeypatch.setattr(serving, "run", started)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_serve_refuses_a_port_a_program_listens_on_with_exit_2_and_one_line(tiny_folder, capsys, no_server_start, host):
    from optimum_iobinding.cli import main

    with listening_socket() as holder:
        port = holder.getsockname()[1]
        status = main(["serve", str(tiny_folder), "--host", host, "--port", str(port), "--device", "cpu"])
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(
        f"optimum-iobinding: error: --port: expected a free port, got "
        f"{port}: something already listens on {host}:{port}"
    )


def test_serve_without_the_serve_extra_says_so_in_one_line(tiny_folder, capsys, no_server_start, monkeypatch):
    from optimum_iobinding.cli import main

    monkeypatch.setitem(sys.modules, "fastapi", None)  # what the import system answers for a missing package
    assert main(["serve", str(tiny_folder), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing fastapi: pip install 'optimum-iobinding[serve]'" in err


def test_the_serving_docs_give_the_max_pixels_per_image_default_that_serve_help_gives(capsys, monkeypatch):
    import re
    from pathlib import Path

    from optimum_iobinding.cli import main

    monkeypatch.setenv("COLUMNS", "1000")  # argparse's help unwrapped
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    (default,) = re.findall(
        r"--max-pixels-per-image MAX_PIXELS_PER_IMAGE .*?default: (.+?) --max-pixels-per-batch", shown
    )
    docs = " ".join((Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text().split())
    assert f"`--max-pixels-per-image` (default: {default}" in docs


# ----------------------------------------------------------------------------------------------- the readiness
class StartingServer:
    """An HTTP server on a port of its own whose ``/health`` is at first not answered (``dropped`` connections
    closed without a word, as a proxy still starting), then answered 503 (``unavailable`` times), then 200; each
    answer given is recorded in ``events``."""

    def __init__(self, dropped: int, unavailable: int, events: list):
        self.events = events
        counter = itertools.count()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def handle(self) -> None:
                self.number = next(counter)
                if self.number < dropped:
                    outer.events.append("health dropped")
                    return  # the connection closes unanswered
                super().handle()

            def do_GET(self) -> None:  # noqa: N802 — http.server's name
                status = 503 if self.number < dropped + unavailable else 200
                outer.events.append(f"health {status}")
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_wait_until_answering_returns_once_health_answers_200():
    events = []
    server = StartingServer(dropped=2, unavailable=2, events=events)
    try:
        assert wait_until_answering(f"http://127.0.0.1:{server.port}/health", timeout_s=120, interval_s=0.01)
    finally:
        server.close()
    assert events == ["health dropped"] * 2 + ["health 503"] * 2 + ["health 200"]


def test_wait_until_answering_gives_up_when_told_or_past_its_time():
    with listening_socket() as holder:  # listens, never answers: each try times out or is dropped
        url = f"http://127.0.0.1:{holder.getsockname()[1]}/health"
        asked = []
        assert not wait_until_answering(
            url,
            timeout_s=60,
            interval_s=0.01,
            try_timeout_s=0.2,
            keep_waiting=lambda: asked.append(1) or len(asked) < 3,
        )
        assert len(asked) == 3
    port = free_port()
    assert not wait_until_answering(f"http://127.0.0.1:{port}/health", timeout_s=0.2, interval_s=0.01)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class FakeServe:
    """``ray.serve`` as :func:`~optimum_iobinding.serve.app.run` uses it: ``start`` starts the "proxy" (a
    :class:`StartingServer` on the port asked for, or ``start_error``), ``run`` deploys (or raises ``run_error``),
    ``status`` reports ``deployment_message`` for a failed deployment."""

    def __init__(self, events: list, start_error=None, run_error=None, deployment_message=""):
        self.events, self.start_error, self.run_error = events, start_error, run_error
        self.deployment_message = deployment_message
        self.proxy = None
        self.deleted = []

    def start(self, http_options):
        if self.start_error:
            raise self.start_error
        self.events.append("proxy started")
        self.proxy = StartingServer(dropped=1, unavailable=2, events=self.events)
        assert self.proxy.port  # a port of its own: the one asked for was checked free, and is still
        self.asked_port = http_options["port"]

    def run(self, application, name, route_prefix, blocking):
        if self.run_error:
            raise self.run_error
        self.events.append("deployed")
        return "handle"

    def status(self):
        from types import SimpleNamespace

        deployment = SimpleNamespace(status="DeploymentStatus.DEPLOY_FAILED", message=self.deployment_message)
        return SimpleNamespace(
            applications={"optimum-iobinding": SimpleNamespace(message="", deployments={"ImageService": deployment})}
        )


@pytest.fixture
def fake_cluster(monkeypatch):
    """``app.run`` on a Ray cluster this process is connected to, whose Serve is ``FakeServe`` (returned as a
    factory); ``/health`` is asked of the fake proxy's port."""
    ray = pytest.importorskip("ray", reason="needs the serve extra (ray[serve])")
    from optimum_iobinding.serve import app

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(app, "build_app", lambda config: "application")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def make(**settings):
        fake = FakeServe(**settings)
        monkeypatch.setattr(app, "serve", fake)
        monkeypatch.setattr(app, "local_url", lambda host, port: f"http://127.0.0.1:{fake.proxy.port}")
        return fake

    return make


def test_run_is_ready_only_once_health_answers(fake_cluster):
    from optimum_iobinding.serve import app

    events = []
    fake = fake_cluster(events=events)
    port = free_port()
    handle = app.run(ServeConfig(model="folder"), port=port, blocking=False, on_ready=lambda: events.append("ready"))
    fake.proxy.close()
    assert handle == "handle" and fake.asked_port == port
    assert events == ["proxy started", "deployed", "health dropped", "health 503", "health 503", "health 200", "ready"]


def test_serve_prints_its_serving_line_only_when_run_says_it_is_ready(tiny_folder, capsys, monkeypatch):
    import optimum_iobinding.serve as serving
    from optimum_iobinding.cli import main

    seen = {}

    def run(config, host, port, dashboard, on_ready):
        seen["before"] = capsys.readouterr().out
        on_ready()
        seen["after"] = capsys.readouterr().out
        return signal.SIGINT

    monkeypatch.setattr(serving, "run", run)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    port = free_port()
    assert main(["serve", str(tiny_folder), "--port", str(port), "--device", "cpu"]) == 130
    assert seen["before"].startswith("optimum-iobinding: starting Ray Serve") and "serving" not in seen["before"]
    assert seen["after"] == (
        f"optimum-iobinding: serving {tiny_folder} on http://127.0.0.1:{port}/v1/images "
        "(1 replica(s), batches of up to 4); Ctrl-C stops\n"
    )


def test_the_python_api_refuses_a_busy_port_naming_port_before_ray_starts(fake_cluster):
    from optimum_iobinding.serve import app

    events = []
    fake_cluster(events=events)
    with listening_socket() as holder:
        port = holder.getsockname()[1]
        with pytest.raises(ArgumentError) as refused:
            app.run(ServeConfig(model="folder"), port=port, blocking=False)
    assert refused.value.argument == "port" and f"127.0.0.1:{port}" in str(refused.value) and events == []


class RemoteError(RuntimeError):
    """What Ray raises for an actor's failed call: its text is the remote traceback, ``cause`` the error."""

    def __init__(self, cause: BaseException):
        super().__init__(
            'ray::ProxyActor.ready() (pid=1, repr=<ProxyActor object at 0x7f00>)\n  File "x", line 1'
            f"\n{type(cause).__name__}: {cause}"
        )
        self.cause = cause


REPLICA_FAILURE = """The deployment failed to start 3 times in a row. This may be due to a problem with its \
constructor or initial health check failing. See controller logs for details. Error:
ray::ServeReplica:optimum-iobinding:ImageService.initialize_and_get_metadata() (pid=7, ip=127.0.0.1, \
actor_id=ab, repr=<ray.serve._private.replica.ServeReplica object at 0x7f5e8c1d0>)
Traceback (most recent call last):
  File "/x/optimum_iobinding/serve/batching.py", line 262, in __init__
optimum_iobinding.errors.ArgumentPathError: pretrained_model_name_or_path: expected a unet

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/x/optimum_iobinding/serve/batching.py", line 270, in __init__
optimum_iobinding.errors.ArgumentPathError: model: expected '/m/unet/model.onnx' (an ONNX Stable Diffusion folder)
"""


@pytest.mark.parametrize(
    "failure, expected",
    [
        (
            dict(start_error=RemoteError(RuntimeError("Failed to bind to address '127.0.0.1:8000'."))),
            "Serve's HTTP proxy did not start on 127.0.0.1:{port}: RuntimeError: Failed to bind to address "
            "'127.0.0.1:8000'.; stop what listens there or choose another port",
        ),
        (
            dict(
                run_error=RuntimeError(
                    "Deploying application optimum-iobinding failed: Failed to update the deployments ['ImageService']."
                ),
                deployment_message=REPLICA_FAILURE,
            ),
            "the replicas did not start: model: expected '/m/unet/model.onnx' (an ONNX Stable Diffusion folder); fix what "
            "it names and start again",
        ),
    ],
    ids=["proxy", "replicas"],
)
def test_a_start_that_fails_is_one_line_saying_what_failed_and_what_to_do(fake_cluster, failure, expected):
    from optimum_iobinding.serve import app

    fake_cluster(events=[], **failure)
    port = free_port()
    with pytest.raises(ServeStartError) as failed:
        app.run(ServeConfig(model="folder"), port=port, blocking=False)
    message = str(failed.value)
    assert message.startswith(expected.format(port=port)) and "\n" not in message and "0x7f" not in message
    assert failed.value.__cause__ is not None  # Ray's error, for --debug


def test_serve_prints_a_failed_start_in_one_line_and_its_traceback_with_debug(tiny_folder, capsys, monkeypatch):
    import optimum_iobinding.serve as serving
    from optimum_iobinding.cli import main

    def run(config, host, port, dashboard, on_ready):
        try:
            raise RuntimeError("Traceback (most recent call last):\n  File ...\nRuntimeError: deep inside Ray")
        except RuntimeError as error:
            raise ServeStartError("the replicas did not start: deep inside Ray; fix what it names") from error

    monkeypatch.setattr(serving, "run", run)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    arguments = ["serve", str(tiny_folder), "--port", str(free_port()), "--device", "cpu"]
    assert main(arguments) == 1
    err = capsys.readouterr().err
    assert err == (
        "optimum-iobinding: error: serve: the replicas did not start: deep inside Ray; fix what it names "
        "(--debug shows the traceback)\n"
    )
    with pytest.raises(ServeStartError) as shown:
        main(["--debug", *arguments])
    assert "deep inside Ray" in str(shown.value.__cause__)


# ----------------------------------------------------------------------------------- what a replica names
def test_a_replica_names_a_folder_it_cannot_load_model_as_it_was_given(tiny_folder, tmp_path):
    pytest.importorskip("ray", reason="needs the serve extra (ray[serve])")
    from dataclasses import asdict

    from optimum_iobinding.serve import ImageGenerator

    folder = tmp_path / "no-unet"
    shutil.copytree(tiny_folder, folder, ignore=shutil.ignore_patterns("unet"))
    with pytest.raises(ArgumentError) as refused:
        ImageGenerator(asdict(ServeConfig(model=str(folder), device="cpu", warmup_batch_sizes=[])))
    assert refused.value.argument == "model" and "unet" in refused.value.reason
    assert "pretrained_model_name_or_path" not in str(refused.value)


# ----------------------------------------------------------------------------------- an image that is no image
def png_bytes() -> bytes:
    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize(
    "data, message",
    [
        (
            base64.b64encode(b"hello, not an image").decode(),
            "image: expected a base64 PNG or JPEG, got 19 bytes of no image Pillow reads (they start with b'hello, n')",
        ),
        (
            base64.b64encode(png_bytes()[:40]).decode(),
            "image: expected a base64 PNG or JPEG, got 40 bytes of no image Pillow reads (they start with "
            "b'\\x89PNG\\r\\n\\x1a\\n')",
        ),
        (
            "not base64!",
            "image: expected a base64 PNG or JPEG, got text that is no base64 (Only base64 data is allowed)",
        ),
    ],
    ids=["text", "cut-png", "not-base64"],
)
def test_an_image_that_is_no_image_is_refused_naming_the_field_without_object_reprs(data, message):
    pytest.importorskip("pydantic")
    from optimum_iobinding.serve.schema import decode_image

    with pytest.raises(ValueError) as refused:
        decode_image(data)
    assert str(refused.value) == message


def test_a_reason_that_names_an_object_names_the_image():
    pytest.importorskip("pydantic")
    from optimum_iobinding.serve.schema import plain_reason

    error = OSError("cannot identify image file <_io.BytesIO object at 0x7f3a2b1c0>")
    assert plain_reason(error) == "cannot identify image file the image"
