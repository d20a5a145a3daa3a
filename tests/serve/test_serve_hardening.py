"""Serving safely: a replica's limits refuse what would exhaust it (400 naming the limit, 413 for a large body) before
any work is queued, and no body gets a 500; a pipeline call that fails through no fault of its request answers 503
while the replica goes on, and a request left too long answers 504; a local cluster listens on loopback only; and
SIGINT or SIGTERM stops ``run`` cleanly: Serve and Ray shut down, nothing dumped on stderr, no Ray process left.

The limits and the batching within them are checked on a replica's generator in this process (no Ray); the HTTP
answers on a real local Ray cluster in this process (CPU replicas, the tiny model); the loopback and the stops on a
server run in a process of its own, as ``optimum-iobinding serve`` runs it."""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import re
import signal
import struct
import subprocess
import sys
import urllib.error
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="needs the serve extra (ray[serve])")
import psutil  # noqa: E402  (vendored by ray: importable once ray is)

from .test_serve import free_port  # noqa: E402

# every test that starts Ray runs in one test process (scripts/test.sh: --dist loadgroup), one cluster at a time: two
# clusters at once on a small machine take each other's cores
pytestmark = pytest.mark.xdist_group("ray")

SIZE = 64
STEPS = 2
REPOSITORY = Path(__file__).resolve().parents[2]


def post(url: str, body, headers=None):
    """``(status, detail or body)`` of a POST of ``body``: a dict (as JSON), bytes, or an iterable of bytes (sent
    chunked, without Content-Length)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(
        url + "/v1/images", data=data, method="POST", headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        content = error.read()
        try:
            return error.code, json.loads(content)["detail"]
        except (ValueError, KeyError):
            return error.code, content


def png_header(width: int, height: int) -> str:
    """A base64 PNG that claims ``width`` × ``height`` pixels (its pixel data is a stub: only its header is read)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")
    return base64.b64encode(data).decode("ascii")


def png_of(pixels: np.ndarray) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


# ------------------------------------------------------------------------------------------ the limits, no Ray
def test_limits_default_to_twice_the_side_the_replica_is_made_for():
    from optimum_iobinding.serve import ServeConfig

    limits = ServeConfig(model="folder").limits(default_size=512, tokenizer_max_length=77)
    assert limits.max_pixels_per_image == 1024 * 1024 and limits.max_pixels_per_batch == 4 * 1024 * 1024
    assert (limits.max_steps, limits.max_prompt_chars, limits.max_prompt_tokens) == (150, 2000, 77)
    assert limits.max_body_bytes == 11 * 1024 * 1024 + 2**20 and limits.request_timeout_s == 300
    larger = ServeConfig(model="folder", warmup_sizes=[768], max_batch_size=2).limits(512, None)
    assert larger.max_pixels_per_image == 1536**2 and larger.max_pixels_per_batch == 2 * 1536**2
    assert larger.max_prompt_tokens is None  # a tokenizer without a length: no token limit unless one is given
    given = ServeConfig(model="folder", max_pixels_per_image=512 * 640, max_prompt_tokens=200).limits(512, 77)
    assert given.max_pixels_per_image == 512 * 640 and given.max_prompt_tokens == 200


def test_the_config_refuses_limits_that_contradict_each_other():
    from optimum_iobinding.serve import ServeConfig

    with pytest.raises(ValueError, match="steps: expected at most max_steps=150, got 200; raise max_steps"):
        ServeConfig(model="folder", steps=200)
    with pytest.raises(ValueError, match="max_pixels_per_batch: expected at least max_pixels_per_image=4096"):
        ServeConfig(model="folder", max_pixels_per_image=4096, max_pixels_per_batch=1024)
    with pytest.raises(ValueError, match="request_timeout_s: expected a positive number of seconds, got 0"):
        ServeConfig(model="folder", request_timeout_s=0)
    with pytest.raises(ValueError, match="max_prompt_tokens: expected a positive integer, got 0"):
        ServeConfig(model="folder", max_prompt_tokens=0)
    for guidance in (float("nan"), float("inf"), -1.0, "7.5"):
        with pytest.raises(ValueError, match="guidance: expected a finite number ≥ 0"):
            ServeConfig(model="folder", guidance=guidance)
    with pytest.raises(ValueError, match="guidance: expected a finite number ≥ 0, got nan"):
        ServeConfig.from_args({"model": "folder", "guidance": "nan"})
    config = ServeConfig.from_args(
        {"model": "folder", "max_pixels_per_image": "4096", "max_steps": "50", "request_timeout_s": "2.5"}
    )
    assert (config.max_pixels_per_image, config.max_steps, config.request_timeout_s) == (4096, 50, 2.5)


@pytest.fixture(scope="module")
def generator(tiny_folder):
    """A replica's generator in this process (no Ray): default size 256, so at most 512² pixels an image."""
    from optimum_iobinding.serve import ImageGenerator, ServeConfig

    return ImageGenerator(
        asdict(ServeConfig(model=str(tiny_folder), device="cpu", max_batch_size=4, steps=STEPS, warmup_batch_sizes=[]))
    )


@pytest.mark.parametrize(
    "request_body, message",
    [
        (dict(size=100000), "size: expected at most 262144 pixels (max_pixels_per_image), got 100000×100000"),
        (dict(size="100000x64"), "(max_pixels_per_image), got 100000×64"),
        (dict(steps=10**9), "steps: expected 1 to 150 (max_steps), got 1000000000"),
        (dict(steps=10**5000), "steps: expected 1 to 150 (max_steps), got an integer of more than"),
        (dict(n=10**6), "n: expected at most 4 images per request (max_images_per_request), got 1000000"),
        (dict(prompt="x" * 100_000), "prompt: expected at most 2000 characters (max_prompt_chars), got 100000"),
        (dict(negative_prompt="x" * 2001), "negative_prompt: expected at most 2000 characters (max_prompt_chars)"),
        (dict(prompt="a cat, " * 60), "prompt: expected at most 77 tokens (max_prompt_tokens)"),
        (
            dict(image=png_header(1000, 1000)),
            "image: expected at most 262144 pixels (max_pixels_per_image), got 1000×1000",
        ),
        (
            dict(image=png_header(100000, 100000)),
            "image: expected at most 262144 pixels (max_pixels_per_image), got "
            "more: Image size (10000000000 pixels) exceeds",
        ),
        (dict(size=0), "size: expected positive pixels"),
        (dict(size="²x2"), "size: expected positive pixels"),
        (dict(size="9" * 5000 + "x64"), "size: expected positive pixels"),
    ],
)
def test_a_request_beyond_a_limit_is_refused_naming_the_limit(generator, request_body, message):
    with pytest.raises(ValueError) as refused:
        generator.complete_request(dict(dict(prompt="a cat", seed=1), **request_body))
    assert message in str(refused.value) and len(str(refused.value)) < 300


def test_counting_a_requests_tokens_beside_a_running_batch_leaves_the_batchs_prompts_as_they_are(generator):
    """Requests are checked on the event loop while a batch encodes its prompts on the pipeline's thread. A fast
    tokenizer keeps its padding and truncation as settings of the one object that each call sets: counted on the
    pipeline's own tokenizer, a request's tokens (no padding) could leave a batch's negative prompt unpadded, two
    tokens against 77 (seen as a 503: "Sizes of tensors must match"). Threads switched as often as Python allows."""
    import threading

    stop = threading.Event()

    def count_tokens() -> None:
        while not stop.is_set():
            generator.complete_request(dict(prompt="a red house", seed=1))

    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    counting = threading.Thread(target=count_tokens)
    counting.start()
    try:
        lengths = {generator.pipe.prompt.encode_text([""]).shape[1] for _ in range(300)}
    finally:
        stop.set()
        counting.join()
        sys.setswitchinterval(switch_interval)
    assert lengths == {generator.pipe.tokenizer.model_max_length}


def test_a_batch_runs_in_calls_within_max_pixels_per_batch(tiny_folder):
    from optimum_iobinding.serve import ImageGenerator, ServeConfig

    generator = ImageGenerator(
        asdict(
            ServeConfig(
                model=str(tiny_folder),
                device="cpu",
                max_batch_size=4,
                steps=STEPS,
                warmup_batch_sizes=[],
                max_pixels_per_batch=2 * SIZE * SIZE,
            )
        )
    )
    requests = [generator.complete_request(dict(prompt=f"a cat {i}", seed=i, size=SIZE)) for i in range(3)]
    answers = generator.run_batch(requests)
    assert [answer["batch_images"] for answer in answers] == [2, 2, 1]
    assert [answer["seeds"] for answer in answers] == [[0], [1], [2]]
    with pytest.raises(ValueError, match=r"\(max_pixels_per_batch\), got 3×64×64; ask for fewer images"):
        generator.complete_request(dict(prompt="three cats", seed=1, size=SIZE, n=3))


def allocation_failing():
    """A generator class whose pipeline fails as ONNX Runtime fails an allocation when a prompt asks for it ("too
    large"), and otherwise is the replica's pipeline (defined here, in a function, so that Ray sends the class itself
    to its replicas)."""
    from optimum_iobinding.serve import ImageGenerator

    class AllocationFails:
        def __init__(self, pipe):
            self.pipe = pipe

        def __call__(self, *args, **kwargs):
            from onnxruntime.capi.onnxruntime_pybind11_state import RuntimeException

            if any("too large" in prompt for prompt in kwargs["prompt"]):
                raise RuntimeException(
                    "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned "
                    "while running Conv node. Name:'/conv_in/Conv' Status Message: Failed to "
                    "allocate memory for requested buffer of size 4294967296\nits context"
                )
            return self.pipe(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.pipe, name)

    class AllocationFailing(ImageGenerator):
        def __init__(self, config):
            super().__init__(config)
            self.pipe = AllocationFails(self.pipe)

    return AllocationFailing


def test_a_failed_call_runs_its_requests_alone_so_only_the_failing_one_gets_503(tiny_folder):
    from optimum_iobinding.serve import ServeConfig

    generator = allocation_failing()(
        asdict(ServeConfig(model=str(tiny_folder), device="cpu", max_batch_size=4, steps=STEPS, warmup_batch_sizes=[]))
    )
    prompts = ["a cat", "a cat too large for memory", "a dog"]
    answers = generator.run_batch(
        [generator.complete_request(dict(prompt=prompt, seed=i, size=SIZE)) for i, prompt in enumerate(prompts)]
    )
    assert [answer.get("status") for answer in answers] == [None, 503, None]
    assert [answer.get("batch_images") for answer in answers] == [1, None, 1]  # each ran alone after the failure
    reason = answers[1]["error"]
    assert "Failed to allocate memory" in reason and "\n" not in reason
    (again,) = generator.run_batch([generator.complete_request(dict(prompt="a bird", seed=3, size=SIZE))])
    assert "images" in again


def test_is_loopback_names_the_loopback_addresses_only():
    from optimum_iobinding.serve.config import is_loopback

    assert all(is_loopback(host) for host in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"))
    assert not any(is_loopback(host) for host in ("0.0.0.0", "::", "192.0.2.1", "example.com"))


def test_a_local_ray_is_set_to_listen_on_loopback_unless_a_cluster_is_given(monkeypatch):
    from optimum_iobinding.serve.config import LOCAL_RAY_ENV, prepare_local_ray

    monkeypatch.setattr(os, "environ", dict(os.environ))  # what it sets stays in this test
    monkeypatch.delenv(LOCAL_RAY_ENV, raising=False)
    monkeypatch.delitem(sys.modules, "ray")  # as before Ray is imported
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert not prepare_local_ray() and LOCAL_RAY_ENV not in os.environ
    monkeypatch.delenv("RAY_ADDRESS")
    assert not prepare_local_ray("ray://10.0.0.1:10001") and LOCAL_RAY_ENV not in os.environ
    assert prepare_local_ray() and os.environ[LOCAL_RAY_ENV] == "0"
    monkeypatch.setenv(LOCAL_RAY_ENV, "1")  # the user's own setting stays
    assert not prepare_local_ray() and os.environ[LOCAL_RAY_ENV] == "1"


def test_a_local_ray_takes_serves_request_path_settings_unless_set_otherwise(monkeypatch):
    from optimum_iobinding.serve.config import SERVE_REQUEST_PATH_ENV, prepare_local_ray

    monkeypatch.setattr(os, "environ", dict(os.environ))  # what it sets stays in this test
    for name in SERVE_REQUEST_PATH_ENV:
        os.environ.pop(name, None)
    os.environ.pop("RAY_ADDRESS", None)
    os.environ["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] = "1"  # the user's own setting stays
    monkeypatch.delitem(sys.modules, "ray")  # as before Ray is imported
    assert not prepare_local_ray("10.0.0.1:6379") and "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD" not in os.environ
    prepare_local_ray()
    wanted = dict(SERVE_REQUEST_PATH_ENV, RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP="1")
    assert {name: os.environ.get(name) for name in SERVE_REQUEST_PATH_ENV} == wanted


def test_a_local_ray_asks_for_the_token_authentication_ray_gives_it_unless_set_otherwise(monkeypatch):
    """Ray 2.60 gives a new local cluster token authentication where RAY_AUTH_MODE is unset, and warns that it did on
    every start; asked for by name, it is the same authentication without the warning."""
    from optimum_iobinding.serve.config import LOCAL_RAY_AUTH_ENV, prepare_local_ray

    assert LOCAL_RAY_AUTH_ENV == {"RAY_AUTH_MODE": "token"}
    monkeypatch.setattr(os, "environ", dict(os.environ))  # what it sets stays in this test
    os.environ.pop("RAY_AUTH_MODE", None)
    os.environ.pop("RAY_ADDRESS", None)
    monkeypatch.delitem(sys.modules, "ray")  # as before Ray is imported
    prepare_local_ray("10.0.0.1:6379")  # a cluster of its own: its own authentication
    assert "RAY_AUTH_MODE" not in os.environ
    prepare_local_ray()
    assert os.environ["RAY_AUTH_MODE"] == "token"
    os.environ["RAY_AUTH_MODE"] = "disabled"  # the user's own setting stays
    prepare_local_ray()
    assert os.environ["RAY_AUTH_MODE"] == "disabled"


def test_serves_note_that_run_connects_to_the_serve_it_started_is_left_out_and_nothing_else():
    import logging

    from optimum_iobinding.serve.app import serve_started_here

    class Kept(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    serve_logger, kept = logging.getLogger("ray.serve"), Kept()
    level = serve_logger.level
    serve_logger.addHandler(kept)
    serve_logger.setLevel(logging.INFO)
    note = 'Connecting to existing Serve app in namespace "serve". New http_options will not be applied.'
    try:
        with serve_started_here():
            serve_logger.info(note)
            serve_logger.info("Application 'optimum-iobinding' is ready.")
        serve_logger.info(note)  # outside run's start: Serve's own
    finally:
        serve_logger.removeHandler(kept)
        serve_logger.setLevel(level)
    assert kept.messages == ["Application 'optimum-iobinding' is ready.", note]


def test_once_ray_is_imported_its_setting_is_left_alone(monkeypatch):
    from optimum_iobinding.serve.config import LOCAL_RAY_ENV, prepare_local_ray

    monkeypatch.delenv(LOCAL_RAY_ENV, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert "ray" in sys.modules and not prepare_local_ray() and LOCAL_RAY_ENV not in os.environ


# -------------------------------------------------------- a server in a process of its own, as the CLI runs it
SERVE = """
import sys
from optimum_iobinding.serve import ServeConfig, run
config = ServeConfig(model=sys.argv[1], device="cpu", steps=2, warmup_batch_sizes=[1], warmup_sizes=[64],
                     max_pixels_per_image=1024 * 1024, max_pixels_per_batch=2 * 1024 * 1024)
stopped = run(config, port=int(sys.argv[2]))
print(f"stopped by {stopped.name}", flush=True)
"""
# The same, its main thread waiting on Ray once the server is ready (as Serve's own calls wait while it starts): a
# task that sleeps, asked for with ray.get
SERVE_WAITING_ON_RAY = SERVE.replace(
    "stopped = run(config, port=int(sys.argv[2]))",
    """import time
import ray
@ray.remote(num_cpus=0)
def sleep():
    time.sleep(600)
def wait_on_ray():
    asked = sleep.remote()
    print("waiting on Ray", flush=True)
    ray.get(asked)
stopped = run(config, port=int(sys.argv[2]), on_ready=wait_on_ray)""",
)


class ServerProcess:
    """``run(config)`` in a process of its own session (as in a terminal of its own), answering /health."""

    def __init__(self, folder, tmp_path, script=SERVE):
        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPOSITORY), os.environ.get("PYTHONPATH", "")]))
        env.pop("RAY_ADDRESS", None)
        self.stdout, self.stderr = open(tmp_path / "stdout", "w+"), open(tmp_path / "stderr", "w+")
        self.process = subprocess.Popen(
            [sys.executable, "-c", script, str(folder), str(self.port)],
            env=env,
            stdout=self.stdout,
            stderr=self.stderr,
            start_new_session=True,
        )
        self.wait_until(self.answers, tries=600)  # up to 10 minutes: Ray's start, then the replica's
        assert self.answers(), f"the server did not start; stderr: {self.errors()[-3000:]}"
        self.processes = [psutil.Process(self.process.pid), *psutil.Process(self.process.pid).children(recursive=True)]

    def wait_until(self, done, tries: int) -> None:
        """Asks ``done()`` once a second, ``tries`` times at most, until it says yes or the server ends."""
        for _ in range(tries):
            if done():
                return
            try:
                self.process.wait(timeout=1)
                return
            except subprocess.TimeoutExpired:
                pass

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as response:
                return response.status == 200
        except (OSError, http.client.HTTPException):  # nothing there yet, or not HTTP: not the server
            return False

    def errors(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()

    def output(self) -> str:
        self.stdout.seek(0)
        return self.stdout.read()

    def stop(self, signum: int, whole_group: bool) -> int:
        """Sends ``signum`` to the server (or its whole process group, as Ctrl-C in a terminal or systemd do);
        returns its exit status."""
        if whole_group:
            os.killpg(self.process.pid, signum)
        else:
            self.process.send_signal(signum)
        try:
            return self.process.wait(timeout=180)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        for process in self.processes:
            try:
                process.kill()
            except psutil.Error:
                pass


@pytest.fixture(scope="module")
def server_process(tiny_folder, tmp_path_factory):
    server = ServerProcess(tiny_folder, tmp_path_factory.mktemp("server"))
    yield server
    if server.process.poll() is None:
        server.kill()


def test_a_local_cluster_listens_on_loopback_only(server_process):
    """Ray's GCS, raylet, agents and workers, Serve's proxy, and each replica's own gRPC server (which Ray Serve
    binds to every interface unless the replica narrows it)."""
    listening, off_loopback = [], []
    for process in server_process.processes:
        try:
            name = process.name()
            sockets = [c for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
        for sock in sockets:
            address = sock.laddr.ip.removeprefix("::ffff:")  # an IPv4 address on a dual-stack socket
            listening.append((name, address, sock.laddr.port))
            if address not in ("127.0.0.1", "::1"):
                off_loopback.append((name, address, sock.laddr.port))
    names = {name for name, _, _ in listening}
    assert {"gcs_server", "raylet"} <= names and server_process.port in {port for _, _, port in listening}
    assert any(name.startswith("ray::ServeReplica") for name in names), listening
    assert off_loopback == [], off_loopback


def test_serves_proxy_and_replicas_run_with_its_request_path_settings(server_process):
    """Serve reads them when it is imported, in each process: where the proxy's router and the replicas' handlers
    run."""
    from optimum_iobinding.serve.config import SERVE_REQUEST_PATH_ENV

    seen = []
    for process in server_process.processes:
        try:
            name, environment = process.name(), process.environ()
        except psutil.Error:
            continue
        if name.startswith(("ray::ProxyActor", "ray::ServeReplica")):
            seen.append((name, {key: environment.get(key) for key in SERVE_REQUEST_PATH_ENV}))
    assert {"ProxyActor", "ServeReplica"} <= {name.split(":")[2].split(".")[0] for name, _ in seen}, seen
    assert all(settings == SERVE_REQUEST_PATH_ENV for _, settings in seen), seen


@pytest.mark.slow
def test_an_answer_beyond_4_mib_comes_whole_through_serves_grpc(server_process):
    """The local cluster's proxy takes the replicas' answers over gRPC, which Serve caps at 4 MiB unless told
    otherwise: four 576² stored PNGs in base64 (5.3 MB) come whole."""
    from PIL import Image

    status, body = post(
        f"http://127.0.0.1:{server_process.port}",
        {"prompt": "a cat", "size": 576, "n": 4, "steps": 1, "response_format": "b64_json"},
    )
    assert status == 200, body
    assert len(body) > 5 * 2**20
    images = [Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))) for item in json.loads(body)["data"]]
    assert [image.size for image in images] == [(576, 576)] * 4


def stopped_cleanly(server: ServerProcess, status: int, signum: int, whole_group: bool = False) -> None:
    errors = server.errors()
    assert status == 0, errors[-3000:]
    assert f"stopped by {signal.Signals(signum).name}" in server.output()
    for dump in ("Traceback", "*** SIG", "received at time", "graceful_shutdown failed", "Failed to connect to GCS"):
        assert dump not in errors, errors[-3000:]
    # Ray's C++ error lines. A SIGTERM sent to the whole group stops the cluster's processes beside the server's:
    # the server's core worker may then report, until it disconnects, that it cannot reach the GCS the same signal
    # stopped; that line and no other is the cluster's going, not a failed shutdown.
    gone = re.compile(r"task_manager\.cc:\d+: Failed to push error to driver for task")
    failed = [
        line
        for line in errors.splitlines()
        if re.match(r"\[[^\]]* E \d+ \d+\]", line) and not (whole_group and gone.search(line))
    ]
    assert failed == [], errors[-3000:]
    _, alive = psutil.wait_procs(server.processes, timeout=120)
    assert alive == [], [process.name() for process in alive]


class FakeRay:
    """A module with ``init``: what :class:`NoNewCluster` guards."""

    def __init__(self):
        self.started = 0

    def init(self, *args, **kwargs):
        self.started += 1


def test_a_shutdown_call_outliving_its_cluster_cannot_start_another_until_it_ends():
    from optimum_iobinding.serve.app import NoNewCluster

    ray_module = FakeRay()
    real_init = ray_module.init
    guard = NoNewCluster(ray_module)
    guard.refuse_until_done()  # the call is still waiting on the cluster that went away
    with pytest.raises(RuntimeError, match="no other is started"):
        ray_module.init(namespace="serve")
    guard.done()
    ray_module.init()
    assert ray_module.started == 1 and ray_module.init == real_init


def test_the_guard_changes_nothing_where_the_shutdown_call_ended_first():
    from optimum_iobinding.serve.app import NoNewCluster

    ray_module = FakeRay()
    real_init = ray_module.init
    guard = NoNewCluster(ray_module)
    guard.done()
    guard.refuse_until_done()
    ray_module.init()
    assert ray_module.started == 1 and ray_module.init == real_init


def test_a_fresh_server_warns_of_nothing_it_set_up_itself(server_process):
    """Neither Ray's warning that it enabled token authentication (the local cluster asks for it) nor Serve's note
    that ``serve.run`` connects to the Serve that ``run`` started a moment before, with its HTTP options."""
    said = server_process.errors() + server_process.output()
    assert "Started Serve" in said  # Serve's own log of the start is there: nothing else was silenced
    assert "Token authentication" not in said and "will not be applied" not in said, said[-3000:]


def test_sigint_to_the_terminal_stops_the_server_cleanly(server_process):  # last of the module's server
    status = server_process.stop(signal.SIGINT, whole_group=True)
    stopped_cleanly(server_process, status, signal.SIGINT)


@pytest.mark.slow
@pytest.mark.parametrize("whole_group", [False, True], ids=["to-the-server", "to-its-process-group"])
def test_sigterm_stops_the_server_cleanly(tiny_folder, tmp_path, whole_group):
    server = ServerProcess(tiny_folder, tmp_path)
    try:
        status = server.stop(signal.SIGTERM, whole_group=whole_group)
    finally:
        if server.process.poll() is None:
            server.kill()
    stopped_cleanly(server, status, signal.SIGTERM, whole_group)


@pytest.mark.slow
def test_a_sigterm_while_the_server_waits_on_ray_stops_it_cleanly(tiny_folder, tmp_path):
    """Ray's waits end on a KeyboardInterrupt raised by a signal handler and keep waiting past any other exception:
    with the whole cluster stopped by the same signal, the server would wait until Ray ends it (status 1, "Failed to
    connect to GCS within 60 seconds")."""
    server = ServerProcess(tiny_folder, tmp_path, script=SERVE_WAITING_ON_RAY)
    try:
        server.wait_until(lambda: "waiting on Ray" in server.output(), tries=60)  # it answers before it waits
        assert "waiting on Ray" in server.output(), server.errors()[-3000:]
        status = server.stop(signal.SIGTERM, whole_group=True)
    finally:
        if server.process.poll() is None:
            server.kill()
    stopped_cleanly(server, status, signal.SIGTERM, whole_group=True)


# ------------------------------------------------------------ HTTP on a local Ray cluster in this process
@pytest.fixture(scope="module")
def server(tiny_folder):
    """The cluster's processes take the request path settings of a local cluster (SERVE_REQUEST_PATH_ENV: the
    proxy's gRPC to the replicas among them), as under ``optimum-iobinding serve``; tests/serve/test_serve.py's cluster
    keeps Serve's defaults (actor calls), as on a cluster of the user's own."""
    from ray import serve

    from optimum_iobinding.serve import ServeConfig, build_app
    from optimum_iobinding.serve.config import SERVE_REQUEST_PATH_ENV

    with pytest.MonkeyPatch.context() as patch:
        for name, value in SERVE_REQUEST_PATH_ENV.items():
            patch.setenv(name, value)
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)  # its processes inherit them
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = ServeConfig(
        model=str(tiny_folder), device="cpu", max_batch_size=4, steps=STEPS, warmup_batch_sizes=[1], warmup_sizes=[SIZE]
    )
    serve.run(build_app(config), name="limits", route_prefix="/", blocking=False)
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def batches_run(url: str) -> int:
    with urllib.request.urlopen(url + "/v1/models", timeout=60) as response:
        return json.loads(response.read())["data"][0]["batches_run"]


def test_the_models_endpoint_lists_the_replicas_limits(server):
    with urllib.request.urlopen(server + "/v1/models", timeout=60) as response:
        (model,) = json.loads(response.read())["data"]
    assert model["limits"]["max_pixels_per_image"] == 512 * 512 and model["limits"]["max_steps"] == 150


def test_requests_beyond_the_limits_get_400_naming_them_and_queue_no_work(server):
    before = batches_run(server)
    bodies = [
        dict(prompt="x", size=100000),
        dict(prompt="x", steps=10**9),
        dict(prompt="x", n=10**6, response_format="b64_json"),
        dict(prompt="x" * 100_000),
        dict(prompt="x", image=png_header(100000, 100000)),
    ]
    answers = [post(server, body) for body in bodies]
    assert [status for status, _ in answers] == [400] * len(bodies)
    for name, (_, detail) in zip(
        ("max_pixels_per_image", "max_steps", "max_images_per_request", "max_prompt_chars", "max_pixels_per_image"),
        answers,
    ):
        assert f"({name})" in detail
    assert batches_run(server) == before


@pytest.mark.parametrize(
    "body, status",
    [
        (b'{"prompt": "x", ', 422),  # malformed JSON
        (b"\xff\xfe\x00", 422),  # not UTF-8
        (b"[" * 100_000 + b"]" * 100_000, 422),  # nested deeper than any parser recurses
        (b'{"prompt": "\\ud800"}', 422),  # a lone surrogate
        (b'{"prompt": ["a", "list"]}', 422),
        (b'{"prompt": "x", "n": 1e30}', 422),
        (b'{"prompt": "x", "seed": 1e400}', 422),
        (b'{"prompt": "x", "guidance": NaN}', 400),
        (b'{"prompt": "x", "size": 1.5}', 422),
        (b'{"prompt": "x", "size": -8}', 400),
        (b'{"prompt": "x", "size": "64x64x64"}', 400),
        (b'{"prompt": "x", "strength": 7, "image": "AAAA"}', 400),
        (b'{"prompt": "x", "image": "not base64!"}', 400),
        (b'{"prompt": "x", "steps": 0}', 400),
        (b"null", 422),
        (b"", 422),
    ],
)
def test_a_hostile_body_gets_an_answer_naming_what_is_wrong_never_500(server, body, status):
    answer_status, detail = post(server, body)
    assert answer_status == status, detail


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_max_body_bytes_gets_413(server, chunked):
    body = json.dumps({"prompt": "x", "image": "A" * 5_000_000}).encode()  # max_body_bytes: 3932160
    sent = (body[i : i + 65536] for i in range(0, len(body), 65536)) if chunked else body
    status, detail = post(server, sent)
    assert status == 413 and "body: expected at most 3932160 bytes (max_body_bytes)" in detail


def odd_replica():
    """A generator class that fails a prompt asking for it ("too large") as ONNX Runtime fails an allocation (as
    :func:`allocation_failing`'s) and holds a call with the prompt "held" until told to let it go (defined in a function
    for Ray, as that one)."""
    import threading

    class HeldCalls(allocation_failing()):
        def __init__(self, config):
            super().__init__(config)
            self.may_go = threading.Event()

        def start_batch(self, requests):
            if any(request["prompt"] == "held" for request in requests):
                assert self.may_go.wait(120), "the test never let the held call go"
            return super().start_batch(requests)

        async def let_go(self) -> None:
            self.may_go.set()

    return HeldCalls


@pytest.fixture(scope="module")
def odd(server, tiny_folder):
    """One more deployment on the module's cluster, at ``/odd``, for what a normal replica never does: its pipeline
    fails or holds calls on request (:func:`odd_replica`); its answers wait at most 6 s and its PNGs are compressed
    (one deployment for these tests: each costs a replica's start)."""
    from ray import serve

    from optimum_iobinding.serve import ServeConfig, build_app

    config = ServeConfig(
        model=str(tiny_folder),
        device="cpu",
        max_batch_size=4,
        batch_wait_timeout_s=0.5,
        steps=STEPS,
        warmup_batch_sizes=[],
        request_timeout_s=6,
        png_compression=9,
    )
    handle = serve.run(
        build_app(config, generator_class=odd_replica()), name="odd", route_prefix="/odd", blocking=False
    )
    yield server + "/odd", handle
    serve.delete("odd")


def test_a_pipeline_failure_gets_503_and_the_replica_serves_the_next_requests(odd):
    """Through a real replica: a pipeline that fails one prompt as ONNX Runtime fails an allocation."""
    url, _ = odd
    bodies = [
        dict(prompt="a cat", seed=1, size=SIZE),
        dict(prompt="a cat too large", seed=2, size=SIZE),
        dict(prompt="a dog", seed=3, size=SIZE),
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda body: post(url, body), bodies))
    later = post(url, dict(prompt="a bird", seed=4, size=SIZE))
    assert [status for status, _ in answers] == [200, 503, 200]
    reason = answers[1][1]
    assert "Failed to allocate memory" in reason and "\n" not in reason
    assert later[0] == 200


@pytest.mark.slow
def test_a_request_not_answered_within_request_timeout_s_gets_504_and_the_replica_goes_on(odd):
    """Its pipeline call is held until the test lets it go, long after the request's time is up."""
    url, handle = odd
    try:
        held = post(url, dict(prompt="held", seed=1, size=SIZE))
    finally:
        handle.let_go.remote().result()
    later = post(url, dict(prompt="a bird", seed=2, size=SIZE))
    assert held[0] == 504 and "request_timeout_s: expected an answer within 6 s" in held[1]
    assert later[0] == 200


def test_a_flood_beyond_the_queues_gets_503_never_500_and_the_admitted_requests_succeed(
    server, tiny_folder, flood_statuses
):
    statuses = flood_statuses(tiny_folder, server, "flood", 16, STEPS, SIZE, post)
    assert set(statuses) <= {200, 503} and 503 in statuses and 200 in statuses, statuses


def test_compressed_pngs_are_encoded_by_the_handler(odd):
    from PIL import Image

    url, _ = odd
    status, data = post(url, dict(prompt="a red house", seed=7, size=SIZE))
    assert status == 200 and data.startswith(b"\x89PNG")
    image = Image.open(io.BytesIO(data))
    assert image.size == (SIZE, SIZE) and len(data) < SIZE * SIZE * 3  # zlib's level 9 beats the stored pixels


def test_normal_requests_are_answered_as_before(server):
    status, data = post(server, dict(prompt="a red house", seed=7, size=SIZE))
    assert status == 200 and data.startswith(b"\x89PNG")
    start = (np.random.RandomState(0).rand(SIZE, SIZE, 3) * 255).astype(np.uint8)
    status, data = post(server, dict(prompt="a painting", seed=8, image=png_of(start), strength=0.5))
    assert status == 200 and data.startswith(b"\x89PNG")
