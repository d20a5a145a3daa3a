"""Serving with Ray Serve on a real local Ray cluster (127.0.0.1, CPU replicas, the tiny model): concurrent HTTP
requests get the images of single calls with their seeds, batching happens, a bad request gets 400 while the others
succeed, and shutting down leaves no Ray process behind; and a replica's batching in this process (its admission
driven by hand, the limits of its next batch)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray", reason="needs the serve extra (ray[serve])")
import psutil  # noqa: E402  (vendored by ray: importable once ray is)

# every test that starts Ray runs in one test process (scripts/test.sh: --dist loadgroup), one cluster at a time: two
# clusters at once on a small machine take each other's cores
pytestmark = pytest.mark.xdist_group("ray")

SIZE = 64
STEPS = 3


def free_port() -> int:
    """A free port below the system's ephemeral range (32768 and up on Linux) and above Ray's worker ports (10002 …
    19999): a port the system hands out (bind to 0) can be handed out again, to one of the processes of the Ray
    cluster the server then starts, before Serve's proxy binds it."""
    for port in random.Random().sample(range(20000, 32768), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000 … 32767")


def post(url: str, body: dict):
    request = urllib.request.Request(
        url + "/v1/images", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()


def until(condition, timeout_s: float = 120.0) -> bool:
    """Whether ``condition()`` came true within ``timeout_s`` (asked again every 10 ms)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def decode_png(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


class Server:
    def __init__(self, folder):
        from ray import serve

        from optimum_iobinding.serve import ServeConfig, build_app

        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        self.ray_processes = psutil.Process().children(recursive=True)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = ServeConfig(
            model=str(folder),
            device="cpu",
            max_batch_size=4,
            batch_wait_timeout_s=1.0,
            steps=STEPS,
            warmup_batch_sizes=[1],
            warmup_sizes=[SIZE],
        )
        serve.run(build_app(config), name="test", route_prefix="/", blocking=False)
        self.url = f"http://127.0.0.1:{port}"
        self.running = True

    def shutdown(self):
        if self.running:
            from ray import serve

            serve.shutdown()
            ray.shutdown()
            self.running = False


@pytest.fixture(scope="module")
def server(tiny_folder):
    server = Server(tiny_folder)
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def reference_pipe(tiny_folder):
    """The tiny model's pipeline in this process, for single calls (its image-to-image and inpainting siblings on the
    same models)."""
    from optimum_iobinding import OnnxStableDiffusionPipeline

    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def as_uint8(image: np.ndarray) -> np.ndarray:
    """A pipeline's float image as the service answers it (as diffusers' numpy_to_pil)."""
    return (np.clip(image, 0, 1) * 255).round().astype(np.uint8)


@pytest.fixture(scope="module")
def reference(reference_pipe):
    """Single calls, one seed each, in this process."""

    def image(prompt: str, seed: int, negative_prompt=None) -> np.ndarray:
        images = reference_pipe(
            prompt,
            negative_prompt=negative_prompt,
            height=SIZE,
            width=SIZE,
            num_inference_steps=STEPS,
            generator=torch.Generator().manual_seed(seed),
            output_type="np",
        ).images
        return as_uint8(images[0])

    return image


def test_health_and_models(server):
    with urllib.request.urlopen(server.url + "/health", timeout=60) as response:
        assert json.loads(response.read()) == {"status": "ok"}
    with urllib.request.urlopen(server.url + "/v1/models", timeout=60) as response:
        (model,) = json.loads(response.read())["data"]
    assert model["pipeline"] == "OnnxStableDiffusionPipeline" and model["max_batch_size"] == 4


def test_concurrent_requests_are_batched_and_each_image_is_its_seeds_single_call_image(server, reference):
    requests = [
        dict(
            prompt=f"a photo of a cat, number {i}",
            negative_prompt="blurry" if i % 2 else None,
            seed=1000 + i,
            size=SIZE,
        )
        for i in range(8)
    ]
    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda body: post(server.url, body), requests))
    assert [status for status, _, _ in answers] == [200] * len(requests), [a[2][:200] for a in answers]
    batch_images = [int(headers["x-batch-images"]) for _, headers, _ in answers]
    assert max(batch_images) > 1, batch_images  # eight requests within a second of each other rode together
    for body, (_, headers, data) in zip(requests, answers):
        assert int(headers["x-seed"]) == body["seed"] and float(headers["x-pipeline-seconds"]) > 0
        expected = reference(body["prompt"], body["seed"], body["negative_prompt"])
        # the same numbers through a batched call: equal up to the uint8 rounding of float noise
        assert np.abs(decode_png(data).astype(int) - expected.astype(int)).max() <= 1


def test_requests_that_come_while_a_batch_runs_ride_together_in_the_next_one(server, tiny_folder):
    """batch_wait_timeout_s=0 (the default): a batch never waits to fill, but the requests that come while one runs
    must not each become a batch of their own (Serve 2.60 forms a batch as soon as a request comes; the replica holds
    them until the running batch ends). In a replica of its own, through Serve's own batch queue and the real
    pipeline, without HTTP: the first batch's pipeline call is held until five more requests wait, so the order of
    events is fixed (over HTTP it depended on how fast the proxy passed the requests on, and CI once saw them split
    3 / 1 / 2)."""
    import threading
    from dataclasses import asdict

    from ray import serve

    from optimum_iobinding.serve import ImageGenerator, ServeConfig

    class FirstCallHeld(ImageGenerator):
        """A generator replica whose first pipeline call waits until the test lets it go."""

        def __init__(self, config):
            super().__init__(config)
            self.first_call_came, self.first_call_may_go = threading.Event(), threading.Event()

        def start_batch(self, requests):
            if not self.first_call_came.is_set():
                self.first_call_came.set()
                assert self.first_call_may_go.wait(120), "the test never let the first batch go"
            return super().start_batch(requests)

        async def first_call_is_held(self) -> bool:
            return self.first_call_came.is_set()

        async def requests_waiting(self) -> int:
            return self.admission.waiting

        async def let_the_first_call_go(self) -> None:
            self.first_call_may_go.set()

        async def batches_run_so_far(self) -> int:
            return self.batches_run

    config = ServeConfig(
        model=str(tiny_folder), device="cpu", max_batch_size=8, batch_wait_timeout_s=0.0, steps=2, warmup_batch_sizes=[]
    )
    deployment = serve.deployment(name="FirstCallHeld", ray_actor_options={"num_cpus": 1}, max_ongoing_requests=16)(
        FirstCallHeld
    )
    replica = serve.run(deployment.bind(asdict(config)), name="held", route_prefix=None, blocking=False)
    try:
        first = replica.generate.remote(dict(prompt="a bird 0", seed=0, size=SIZE))
        assert until(lambda: replica.first_call_is_held.remote().result())
        try:
            later = [replica.generate.remote(dict(prompt=f"a bird {i}", seed=i, size=SIZE)) for i in range(1, 6)]
            assert until(lambda: replica.requests_waiting.remote().result() == 5)  # the five wait at the gate
        finally:
            replica.let_the_first_call_go.remote().result()  # also when an assertion failed
        answers = [response.result(timeout_s=300) for response in (first, *later)]
        batches_run = replica.batches_run_so_far.remote().result()
    finally:
        serve.delete("held")
    assert [answer.get("error") for answer in answers] == [None] * 6
    assert [answer["batch_images"] for answer in answers] == [1, 5, 5, 5, 5, 5]
    assert [answer["seeds"] for answer in answers] == [[i] for i in range(6)]
    assert batches_run == 2


# The replica's gate in front of Serve's batch queue, driven by hand (no Ray): while a batch runs nobody enters; when
# it ends, the oldest waiting requests enter, as many images as one batch holds.
async def waiting_behind_a_running_batch(admission, images):
    """A request of one image let in and its batch started; then requests of ``images`` images each, waiting."""
    await admission.admit(1)
    admission.batch_started(1)
    waiters = [asyncio.ensure_future(admission.admit(n)) for n in images]
    await asyncio.sleep(0)  # (lets the waiters run up to their wait)
    return waiters


def test_an_idle_replica_lets_a_request_in_at_once():
    from optimum_iobinding.serve import Admission

    async def scenario():
        admission = Admission(batch_cap=3)
        await admission.admit(1)
        assert admission.admitted == 1 and admission.waiting == 0

    asyncio.run(scenario())


def test_no_request_enters_while_a_batch_runs():
    from optimum_iobinding.serve import Admission

    async def scenario():
        admission = Admission(batch_cap=3)
        waiters = await waiting_behind_a_running_batch(admission, (1, 2, 1, 1))
        assert admission.batch_running and not any(waiter.done() for waiter in waiters)
        assert admission.waiting == 4 and admission.waiting_images == 5 and admission.admitted == 0

    asyncio.run(scenario())


def test_when_the_running_batch_ends_the_oldest_waiting_requests_enter_as_one_batch():
    from optimum_iobinding.serve import Admission

    async def scenario():
        admission = Admission(batch_cap=3)
        waiters = await waiting_behind_a_running_batch(admission, (1, 2, 1, 1))
        admission.batch_queued()
        admission.batch_finished()  # the batch ended and its request was answered
        await asyncio.sleep(0)
        assert [waiter.done() for waiter in waiters] == [True, True, False, False]  # 1 + 2 images: a full batch
        assert admission.admitted == 3 and admission.waiting == 2

    asyncio.run(scenario())


def test_a_client_that_goes_away_while_it_waits_is_forgotten():
    from optimum_iobinding.serve import Admission

    async def scenario():
        admission = Admission(batch_cap=3)
        waiters = await waiting_behind_a_running_batch(admission, (1, 2, 1, 1))
        admission.batch_queued()
        admission.batch_finished()
        await asyncio.sleep(0)
        waiters[2].cancel()  # its client went away while it waited
        await asyncio.sleep(0)
        admission.batch_started(3)  # the batch of the first two ran and was answered
        admission.batch_queued()
        admission.batch_finished()
        await asyncio.sleep(0)
        assert waiters[3].done() and admission.admitted == 1 and admission.waiting == 0

    asyncio.run(scenario())


def test_on_cuda_the_next_batch_enters_once_the_running_ones_work_is_queued():
    """Two batches may be unfinished: the next one queues behind the running one on the GPU."""
    from optimum_iobinding.serve import Admission

    async def scenario():
        admission = Admission(batch_cap=3, max_unfinished=2)
        (waiter,) = await waiting_behind_a_running_batch(admission, (1,))
        admission.batch_queued()
        await asyncio.sleep(0)
        assert waiter.done() and admission.unfinished == 1 and admission.admitted == 1

    asyncio.run(scenario())


def test_on_cpu_the_next_batch_enters_once_the_running_ones_images_are_back():
    from optimum_iobinding.serve import Admission

    async def scenario():
        admission = Admission(batch_cap=3, max_unfinished=1)
        (waiter,) = await waiting_behind_a_running_batch(admission, (1,))
        admission.batch_queued()
        await asyncio.sleep(0)
        assert not waiter.done() and admission.unfinished == 1
        admission.batch_finished()
        await asyncio.sleep(0)
        assert waiter.done() and admission.admitted == 1

    asyncio.run(scenario())


@pytest.fixture
def generator(tiny_folder):
    """A replica's generator in this process (no Ray), up to 3 images per batch, no batch wait."""
    from dataclasses import asdict

    from optimum_iobinding.serve import ImageGenerator, ServeConfig

    return ImageGenerator(
        asdict(ServeConfig(model=str(tiny_folder), device="cpu", max_batch_size=3, warmup_batch_sizes=[]))
    )


def test_a_cpu_replica_lets_in_batches_of_max_batch_size_one_unfinished_at_a_time(generator):
    assert generator.batch_limits == (3, 0.0) and generator.admission.batch_cap == 3
    assert generator.admission.max_unfinished == 1 and not generator.defers_images


def test_after_a_lone_requests_batch_the_next_batch_waits_for_nothing(generator):
    generator.expect_return(1, 1.0)
    assert generator.batch_limits == (3, 0) and generator.admission.batch_cap == 3


def test_after_a_batch_of_several_images_the_next_one_waits_a_little_for_as_many(generator):
    """Nobody waits after a batch of two images: the next batch waits a share of the last one's time for two images
    (its clients coming back)."""
    from optimum_iobinding.serve import REGROUP_WAIT

    generator.expect_return(2, 1.0)
    assert generator.batch_limits == pytest.approx((2, REGROUP_WAIT)) and generator.admission.batch_cap == 2


def test_a_regroup_takes_the_requests_already_waiting_along_so_a_split_group_heals(generator):
    """After a batch of two, two images are expected back; one request already waits (left over from a group split
    before): the next batch waits for three, not two, so the leftover rides with them."""
    from optimum_iobinding.serve import REGROUP_WAIT

    async def scenario():
        generator.admission.batch_started(0)  # a batch runs: a request now waits at the gate
        waiting = asyncio.ensure_future(generator.admission.admit(1))
        await asyncio.sleep(0)
        assert generator.admission.waiting_images == 1
        generator.expect_return(2, 1.0)
        waiting.cancel()

    asyncio.run(scenario())
    assert generator.batch_limits == pytest.approx((3, REGROUP_WAIT)) and generator.admission.batch_cap == 3


def test_a_regroup_whose_clients_did_not_come_back_in_time_is_over_for_the_next_idle_arrival(generator):
    from optimum_iobinding.serve import IDLE_GATHER_WAIT

    generator.expect_return(2, 1000.0)  # their wait (100 s) has not run out: the regroup stays
    regroup = generator.batch_limits
    generator.on_arrival()
    assert generator.batch_limits == regroup and regroup[0] == 2
    generator.expect_return(2, 0.0)  # a wait that has run out: the arrival starts as on a fresh replica
    generator.on_arrival()
    assert generator.batch_limits == (3, IDLE_GATHER_WAIT)


def test_on_an_idle_replica_that_expects_company_a_batch_waits_for_more_unless_a_regroup_set_its_limits(generator):
    from optimum_iobinding.serve import IDLE_GATHER_WAIT

    assert generator.expects_company and generator.admission.idle  # a fresh replica: its first users may be a burst
    generator.gather_on_idle()
    assert generator.batch_limits == (3, IDLE_GATHER_WAIT) and generator.admission.batch_cap == 3
    generator.expect_return(2, 1.0)  # clients coming back after a batch of two: that wait is kept
    regroup = generator.batch_limits
    generator.gather_on_idle()
    assert generator.batch_limits == regroup != (3, IDLE_GATHER_WAIT)


# Run in a process of its own: Serve's batch queue belongs to the batched function (every ImageGenerator of a process
# shares it) and to the event loop that first used it.
_BURST_AND_LONE_CLIENT = """
import asyncio, json, sys
from dataclasses import asdict

from ray.serve import batching

from optimum_iobinding.serve import ImageGenerator, ServeConfig
from optimum_iobinding.serve import batching as ours

# Serve's batch queue, made outside a replica, would read the replica's settings for a warning only
assert hasattr(batching._BatchQueue, "_warn_if_max_batch_size_exceeds_max_ongoing_requests")
batching._BatchQueue._warn_if_max_batch_size_exceeds_max_ongoing_requests = lambda self: None
generator = ImageGenerator(asdict(ServeConfig(model=sys.argv[1], device="cpu", max_batch_size=3,
                                              warmup_batch_sizes=[])))
gather = ours.IDLE_GATHER_WAIT
body = dict(prompt="a red house", size=int(sys.argv[2]), steps=1)


async def apart(*seeds):
    # the later requests sent once the first is in Serve's batch queue and its batch would have started without a
    # wait (the event loop went round many times)
    first = asyncio.ensure_future(generator.generate(dict(body, seed=seeds[0])))
    for _ in range(50):
        await asyncio.sleep(0)
    results = await asyncio.gather(first, *[generator.generate(dict(body, seed=seed)) for seed in seeds[1:]])
    return [result.get("batch_requests", result.get("error")) for result in results]


async def scenario():
    seen = {"fresh": generator.expects_company}
    ours.IDLE_GATHER_WAIT = 600.0  # the burst fills the batch (3 images) long before: no clock decides
    seen["burst"] = await apart(1, 2, 3)
    ours.IDLE_GATHER_WAIT = gather
    seen["after_burst"] = generator.expects_company
    seen["lone"] = [(await generator.generate(dict(body, seed=4)))["batch_requests"]]
    seen["after_lone"] = generator.expects_company
    generator.expect_return(2, 1.0)  # a lone client's batch of two images: nobody else to wait for
    seen["limits_after_lone"] = list(generator.batch_limits)
    seen["next"] = await apart(5, 6, 7)
    seen["after_next"] = generator.expects_company
    return seen


print("SEEN " + json.dumps(asyncio.run(scenario())))
"""


def test_a_fresh_replica_gathers_a_burst_into_one_batch_and_a_lone_clients_requests_start_at_once(tiny_folder):
    """The first request of a fresh replica waits (IDLE_GATHER_WAIT) for others: those that come meanwhile ride in
    its batch. A batch of one request during which nothing else came marks a lone client: then the first of the
    same requests starts without waiting, and the later ones ride in the next batch together."""
    done = subprocess.run(
        [sys.executable, "-c", _BURST_AND_LONE_CLIENT, str(tiny_folder), str(SIZE)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("SEEN ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    seen = json.loads(lines[-1][5:])
    assert seen["fresh"] and seen["burst"] == [3, 3, 3] and seen["after_burst"]  # a batch of three: company
    assert seen["lone"] == [1] and not seen["after_lone"]  # waited for company; none came, before or after
    assert seen["limits_after_lone"] == [3, 0.0]
    assert seen["next"] == [1, 2, 2] and seen["after_next"]  # others came while the first one's batch ran


def test_the_warm_up_runs_on_the_thread_of_the_pipeline_calls_so_their_first_batch_finds_it_done(tiny_folder):
    """ONNX Runtime keeps captured CUDA graphs per thread, as the models keep their reused output buffers: a warm-up
    on another thread than the batches' would leave a fresh replica's first batches to start over."""
    from dataclasses import asdict

    from optimum_iobinding.serve import ImageGenerator, ServeConfig

    generator = ImageGenerator(
        asdict(
            ServeConfig(
                model=str(tiny_folder),
                device="cpu",
                max_batch_size=2,
                steps=2,
                warmup_batch_sizes=[1, 2],
                warmup_sizes=[SIZE],
            )
        )
    )
    unet = generator.pipe.unet
    warmed = generator.on_pipeline_thread(lambda: unet.output_signatures)
    assert warmed > 0 and unet.output_signatures == 0  # nothing was left in this thread
    request = generator.complete_request(dict(prompt="a red house", seed=1, size=SIZE))
    generator.run_batch([request])
    assert generator.on_pipeline_thread(lambda: unet.output_signatures) == warmed


def test_n_images_come_from_consecutive_seeds_as_base64_json(server, reference):
    status, headers, data = post(
        server.url, dict(prompt="a red house", seed=7, size=SIZE, n=2, response_format="b64_json")
    )
    assert status == 200, data
    answer = json.loads(data)
    assert [item["seed"] for item in answer["data"]] == [7, 8]
    for item in answer["data"]:
        image = decode_png(base64.b64decode(item["b64_json"]))
        assert np.abs(image.astype(int) - reference("a red house", item["seed"]).astype(int)).max() <= 1


def test_a_bad_request_gets_400_with_the_pipelines_message_while_the_others_succeed(server):
    bodies = [
        dict(prompt="fine", seed=1, size=SIZE),
        dict(prompt="wrong size", seed=2, size=SIZE + 8),
        dict(prompt="fine too", seed=3, size=SIZE),
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda body: post(server.url, body), bodies))
    assert [status for status, _, _ in answers] == [200, 400, 200]
    detail = json.loads(answers[1][2])["detail"]
    assert "height" in detail and str(SIZE + 8) in detail  # the pipeline's own check, naming the value


@pytest.mark.parametrize(
    "body",
    [
        {"seed": 1},  # no prompt
        {"prompt": "x", "n": "two"},
        {"prompt": "x", "steps_count": 3},  # unknown field
        {"prompt": "x", "seed": -1},
    ],
)
def test_a_malformed_body_gets_422(server, body):
    status, _, _ = post(server.url, body)
    assert status == 422


def test_values_the_api_refuses_get_400(server):
    status, _, data = post(server.url, dict(prompt="x", n=2))  # two images cannot be one png
    assert status == 400 and "b64_json" in json.loads(data)["detail"]
    status, _, data = post(server.url, dict(prompt="x", size="64 by 64"))
    assert status == 400 and "size" in json.loads(data)["detail"]
    status, _, data = post(server.url, dict(prompt="x", n=9, response_format="b64_json"))
    assert status == 400 and "at most 4" in json.loads(data)["detail"]


def test_the_loadtest_reports_throughput_and_latency_percentiles(server, tmp_path):
    from optimum_iobinding.serve.loadtest import run_loadtest, write_results

    rows = run_loadtest(server.url, [1, 3], 3, {"prompt": "a dog", "seed": 5, "size": SIZE}, warmup=0)
    for row, level in zip(rows, (1, 3)):
        assert row["concurrency"] == level and row["ok"] == 3 and row["statuses"] == {"200": 3}
        assert row["images_per_s"] > 0 and 0 < row["p50_s"] <= row["p95_s"] <= row["p99_s"]
        assert sum(row["batch_images"].values()) == 3
        # the service's account of the time nests: pipeline call ⊂ replica ⊂ ingress ⊂ what the client waited
        assert 0 < row["pipeline_mean_s"] <= row["replica_mean_s"] <= row["server_mean_s"] <= row["mean_s"]
        # stored PNGs (the default) are encoded on the batch's finishing thread: within the replica's time
        assert 0 < row["body_mean_s"] <= row["server_mean_s"] - row["replica_mean_s"]
        assert 0 < row["encode_mean_s"] < row["replica_mean_s"] - row["pipeline_mean_s"]
    written = write_results(tmp_path, rows, {"url": server.url, "command": "test", "date": "now"})
    assert json.loads(written[0].read_text())["rows"][1]["concurrency"] == 3
    assert "| 3 | 3 (3) |" in written[1].read_text()


def test_image_to_image_requests_get_their_seeds_single_call_image(server, tiny_folder):
    from PIL import Image

    from optimum_iobinding import OnnxStableDiffusionImg2ImgPipeline

    start = np.random.RandomState(0).randint(0, 256, (SIZE, SIZE, 3)).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(start).save(buffer, format="PNG")
    image = base64.b64encode(buffer.getvalue()).decode("ascii")
    bodies = [dict(prompt=f"a painting {i}", seed=20 + i, image=image, strength=0.6) for i in range(3)]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda body: post(server.url, body), bodies))
    assert [status for status, _, _ in answers] == [200] * len(bodies), [a[2][:300] for a in answers]
    pipe = OnnxStableDiffusionImg2ImgPipeline.from_pretrained(tiny_folder)
    pipe.set_progress_bar_config(disable=True)
    for body, (_, _, data) in zip(bodies, answers):
        single = pipe(
            body["prompt"],
            image=start.astype(np.float32) / 255.0,
            strength=0.6,
            num_inference_steps=STEPS,
            generator=torch.Generator().manual_seed(body["seed"]),
            output_type="np",
        ).images[0]
        expected = (np.clip(single, 0, 1) * 255).round().astype(np.uint8)
        assert np.abs(decode_png(data).astype(int) - expected.astype(int)).max() <= 1
    status, _, data = post(server.url, dict(prompt="x", image=image, size=SIZE * 2))
    assert status == 400 and "the image is 64x64" in json.loads(data)["detail"]
    status, _, data = post(server.url, dict(prompt="x", strength=0.5))
    assert status == 400 and "strength: only an image-to-image request" in json.loads(data)["detail"]
    status, _, data = post(server.url, dict(prompt="x", image="not an image"))
    assert status == 400 and "image: expected a base64 PNG or JPEG" in json.loads(data)["detail"]


@pytest.mark.slow
def test_overload_gets_503_and_the_admitted_requests_succeed(server, tiny_folder, flood_statuses):
    statuses = flood_statuses(tiny_folder, server.url, "overload", 12, STEPS, SIZE, post)
    assert set(statuses) <= {200, 503} and 503 in statuses and 200 in statuses, statuses


def test_a_second_server_on_the_port_of_a_running_one_is_refused_before_anything_starts(
    server, tiny_folder, capsys, monkeypatch
):
    """Serve's proxy binds its port with SO_REUSEPORT: a second one on the same port would share it, silently. The
    command line (exit status 2, one line naming host and port) and the Python API (naming ``port``) refuse it."""
    import optimum_iobinding.serve as serving
    from optimum_iobinding.cli import main
    from optimum_iobinding.errors import ArgumentError
    from optimum_iobinding.serve import ServeConfig, app

    def started(*args, **kwargs):
        raise AssertionError("a second server was started")

    port = int(server.url.rsplit(":", 1)[1])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with monkeypatch.context() as patch:
        patch.setattr(serving, "run", started)
        assert main(["serve", str(tiny_folder), "--port", str(port), "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert (
        out == ""
        and err.count("\n") == 1
        and f"--port: expected a free port, got {port}: something already listens on 127.0.0.1:{port}" in err
    )
    monkeypatch.setattr(app.serve, "start", started)  # the cluster of this process is running: nothing may start
    with pytest.raises(ArgumentError) as refused:
        serving.run(ServeConfig(model=str(tiny_folder), device="cpu"), port=port, blocking=False)
    assert refused.value.argument == "port" and f"127.0.0.1:{port}" in str(refused.value)
    test_health_and_models(server)  # the running one goes on


def test_an_image_field_that_is_no_image_gets_400_naming_the_field_and_no_object(server):
    status, _, data = post(server.url, dict(prompt="x", image=base64.b64encode(b"GIF? no, text").decode()))
    detail = json.loads(data)["detail"]
    assert status == 400 and detail == (
        "image: expected a base64 PNG or JPEG, got 13 bytes of no image Pillow reads (they start with b'GIF? no,')"
    )
    status, _, data = post(server.url, dict(prompt="x", guidance=float("nan")))  # refused by the pipeline's check
    assert status == 400 and json.loads(data)["detail"].startswith("guidance: expected a finite number, got nan")


def test_a_size_the_server_cannot_read_and_an_image_of_a_size_the_pipeline_refuses_name_their_fields(generator):
    """``size: "abc"`` came back with ``param`` null (the refusal carried no field); an edit's image of a size the
    pipeline refuses, sent without ``size``, was blamed on ``size``."""
    from PIL import Image

    from optimum_iobinding.serve.batching import refusal

    with pytest.raises(ValueError, match=r"^size: expected positive pixels as 512 or '768x512'") as refused:
        generator.complete_request(dict(prompt="x", size="abc"))
    assert refusal(refused.value)["param"] == "size"
    buffer = io.BytesIO()
    Image.new("RGB", (SIZE + 8, SIZE)).save(buffer, format="PNG")
    image = base64.b64encode(buffer.getvalue()).decode()
    with pytest.raises(ValueError) as refused:
        generator.complete_request(dict(prompt="x", image=image))
    message = str(refused.value)
    assert refusal(refused.value)["param"] == "image"
    assert message.startswith(f"image: its size {SIZE + 8}x{SIZE} (the request gives no size): height and width")
    with pytest.raises(ValueError, match=r"^size: the image is \d+x\d+; leave size out or give that"):
        generator.complete_request(dict(prompt="x", image=image, size=SIZE))


def test_the_pipelines_refusals_name_the_requests_fields(generator):
    wrong = SIZE + 8
    with pytest.raises(
        ValueError,
        match=rf"^size: height and width expected multiples of \d+ .*got {wrong} and "
        rf"{wrong}",
    ):
        generator.complete_request(dict(prompt="x", size=wrong))
    with pytest.raises(ValueError, match=r"^guidance: expected a finite number, got nan"):
        generator.complete_request(dict(prompt="x", guidance=float("nan")))


def load_serve_bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_bench.py"
    spec = importlib.util.spec_from_file_location("serve_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmarks_floor_deployment_answers_the_payload_after_its_wait(server):
    """benchmarks/serve_bench.py's floor of Ray Serve: on this cluster's proxy (beside the module's application, at a
    route of its own), it answers as many bytes as asked, as a PNG, only after its wait."""
    from ray import serve

    from optimum_iobinding.serve.loadtest import run_loadtest

    bench = load_serve_bench()
    wait_s = 0.05
    serve.run(bench.floor_app(1234, wait_s), name="floor", route_prefix="/floor", blocking=False)
    try:
        status, headers, data = post(server.url + "/floor", {"prompt": "x"})
        (row,) = run_loadtest(server.url + "/floor", [1], 3, {"prompt": "x"}, warmup=0)
    finally:
        serve.delete("floor")
    assert status == 200 and headers["content-type"] == "image/png" and len(data) == 1234
    assert float(headers["x-server-seconds"]) >= wait_s  # the handler's own clock: it waited, then answered
    assert row["statuses"] == {"200": 3} and row["server_mean_s"] >= wait_s


def test_the_benchmark_reports_served_minus_bare_minus_floor():
    bench = load_serve_bench()
    rows = [
        {"engine": "optimum-iobinding", "replicas": 1, "batching": True, "concurrency": 1, "p50_s": 0.260},
        {"engine": "optimum-iobinding", "replicas": 1, "batching": True, "concurrency": 1, "p50_s": 0.5, "fresh": True},
        {"engine": "optimum-iobinding", "replicas": 1, "batching": True, "concurrency": 16, "p50_s": 2.0},
        {"engine": "diffusers-numpy", "replicas": 1, "batching": False, "concurrency": 1, "p50_s": 0.3},
    ]
    result = {
        "bare": {"latency_batch1_s": 0.240},
        "rows": rows,
        "floor": {"wait_s": 0.240, "payload_bytes": 787000, "p50_s": 0.254, "statuses": {"200": 16}},
    }
    summary = bench.floor_summary(result)
    assert summary["overhead_p50_s"] == pytest.approx(0.014)
    (served,) = summary["served_c1"]
    assert served["beyond_floor_s"] == pytest.approx(0.260 - 0.240 - 0.014)
    lines = bench.floor_lines(result)
    assert "**14.0 ms** beyond its wait" in lines[0] and "= **6.0 ms**" in lines[1]
    assert bench.floor_summary(dict(result, floor=None)) == {} and bench.floor_lines(dict(result, floor=None)) == []


# ----------------------------------------------------------- OpenAI's images API, through the official client
@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai", reason="the official OpenAI client (the test extra)")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def png_bytes(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def test_openais_client_generates_images_each_its_seeds_single_call_image(client, reference, tiny_folder):
    answer = client.images.generate(
        model=tiny_folder.name, prompt="a red house", n=2, size=f"{SIZE}x{SIZE}", extra_body={"seed": 7}
    )
    assert [item.seed for item in answer.data] == [7, 8] and answer.size == f"{SIZE}x{SIZE}"
    for item in answer.data:
        image = decode_png(base64.b64decode(item.b64_json))
        assert np.abs(image.astype(int) - reference("a red house", item.seed).astype(int)).max() <= 1


def test_openais_client_edits_an_image_inpainting_where_the_mask_is_transparent_else_image_to_image(
    client, reference_pipe
):
    start = np.random.default_rng(3).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    mask = np.full((SIZE, SIZE, 4), 255, np.uint8)
    mask[SIZE // 4 : 3 * SIZE // 4, SIZE // 4 : 3 * SIZE // 4, 3] = 0  # transparent: repainted
    image = ("start.png", png_bytes(start), "image/png")
    inpainted = client.images.edit(
        image=image, mask=("mask.png", png_bytes(mask), "image/png"), prompt="a cat", extra_body={"seed": 3}
    )
    varied = client.images.edit(image=image, prompt="a cat", extra_body={"seed": 4, "strength": 0.6})
    common = dict(num_inference_steps=STEPS, output_type="np")
    expected_inpainted = reference_pipe.inpainting()(
        "a cat",
        image=start.astype(np.float32) / 255.0,
        mask_image=(mask[..., 3] == 0).astype(np.float32),
        height=SIZE,
        width=SIZE,
        generator=torch.Generator().manual_seed(3),
        **common,
    ).images[0]
    expected_varied = reference_pipe.image_to_image()(
        "a cat",
        image=start.astype(np.float32) / 255.0,
        strength=0.6,
        generator=torch.Generator().manual_seed(4),
        **common,
    ).images[0]
    for answer, expected in ((inpainted, expected_inpainted), (varied, expected_varied)):
        (item,) = answer.data
        got = decode_png(base64.b64decode(item.b64_json)).astype(int)
        assert np.abs(got - as_uint8(expected).astype(int)).max() <= 1


def test_openais_client_gets_a_refusal_in_openais_error_shape_naming_the_field(client):
    import openai

    refusals = [
        (lambda: client.images.generate(prompt="x", size=f"{SIZE + 8}x{SIZE}"), "size", "multiples of"),
        (lambda: client.images.generate(prompt="x", response_format="url"), "response_format", "no URL to give"),
        (lambda: client.images.generate(prompt="x", extra_body={"stepz": 2}), "stepz", "did you mean steps?"),
        (
            lambda: client.images.edit(
                image=("a.png", png_bytes(np.zeros((SIZE, SIZE, 3), np.uint8))),
                prompt="x",
                mask=("m.png", png_bytes(np.zeros((8, 8), np.uint8))),
            ),
            "mask",
            f"mask: expected the image's size, {SIZE}x{SIZE}, got 8x8",
        ),
    ]
    for call, param, message in refusals:
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        error = refused.value
        assert (error.param, error.type, error.body["param"]) == (param, "invalid_request_error", param)
        assert message in error.body["message"]
    with pytest.raises(openai.NotFoundError) as refused:
        client.images.generate(prompt="x", model="dall-e-3")
    assert refused.value.param == "model" and refused.value.code == "model_not_found"


def test_shutdown_leaves_no_ray_process(server):  # last: it ends the module's server
    processes = [p for p in server.ray_processes if p.is_running()]
    assert any("raylet" in p.name() for p in processes)
    server.shutdown()
    _, alive = psutil.wait_procs(processes, timeout=120)
    assert alive == [], [p.name() for p in alive]


def test_config_from_serve_run_arguments():
    from optimum_iobinding.serve import ServeConfig

    config = ServeConfig.from_args(
        {
            "model": "folder",
            "replicas": "2",
            "max_batch_size": "8",
            "batch_wait_timeout_s": "0.1",
            "warmup_batch_sizes": "1,2,4",
        }
    )
    assert (config.replicas, config.max_batch_size, config.batch_wait_timeout_s) == (2, 8, 0.1)
    assert config.warmup_batch_sizes == [1, 2, 4]
    with pytest.raises(ValueError, match="replicas: expected an integer, got 'two'"):
        ServeConfig.from_args({"model": "folder", "replicas": "two"})
    with pytest.raises(ValueError, match=r"unknown \['replica'\]"):
        ServeConfig.from_args({"model": "folder", "replica": "2"})
    with pytest.raises(ValueError, match="max_batch_size: expected a positive integer, got 0"):
        ServeConfig(model="folder", max_batch_size=0)
    assert ServeConfig.from_args({"model": "folder", "png_compression": "6"}).png_compression == 6
    with pytest.raises(ValueError, match="png_compression: expected a zlib level 0–9, got 10"):
        ServeConfig(model="folder", png_compression=10)


@pytest.mark.parametrize("compression", [0, 1, 9])
def test_png_answers_are_the_pixels_at_every_compression(compression):
    from optimum_iobinding.serve import encode_pngs

    pixels = [
        np.random.RandomState(0).randint(0, 256, (5, 7, 3)).astype(np.uint8),  # not square: rows are rows
        np.full((3, 2, 3), 200, np.uint8),
    ]
    encoded = encode_pngs(pixels, compression)
    for image, data in zip(pixels, encoded):
        assert data.startswith(b"\x89PNG") and np.array_equal(decode_png(data), image)
    assert len(encode_pngs(pixels[1:], 0)[0]) > len(encode_pngs(pixels[1:], 9)[0])  # 0 is stored, 9 compressed


@pytest.mark.parametrize("compression", [0, 6])
def test_stored_pngs_are_made_with_their_batch_and_compressed_ones_left_to_the_handler(tiny_folder, compression):
    """Stored PNGs come with the batch's answers (on its finishing thread), each its request's images; compressed
    ones are not made there (the handler encodes them on threads of their own)."""
    from dataclasses import asdict

    from optimum_iobinding.serve import ImageGenerator, ServeConfig

    generator = ImageGenerator(
        asdict(
            ServeConfig(
                model=str(tiny_folder),
                device="cpu",
                max_batch_size=3,
                steps=STEPS,
                warmup_batch_sizes=[],
                png_compression=compression,
            )
        )
    )
    requests = [
        generator.complete_request(dict(prompt="a red house", seed=1, size=SIZE, n=2)),
        generator.complete_request(dict(prompt="a blue boat", seed=5, size=SIZE)),
    ]
    answers = generator.answers_of_batch(generator.start_batch(requests))
    assert [len(answer["images"]) for answer in answers] == [2, 1]
    if compression:
        assert all("pngs" not in answer for answer in answers)
        return
    for answer in answers:
        assert len(answer["pngs"]) == len(answer["images"]) and answer["encode_s"] > 0
        for data, image in zip(answer["pngs"], answer["images"]):
            assert np.array_equal(decode_png(data), image)


def test_serve_command_checks_its_arguments_before_starting_ray(tmp_path, capsys):
    from optimum_iobinding.cli import main

    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "model: expected an existing local folder" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--replicas", "0"]) == 2
    assert "replicas: expected a positive integer, got 0" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--port", "70000"]) == 2
    assert main(["loadtest", "http://127.0.0.1:1", "--concurrency", "0"]) == 2
    assert "--concurrency: expected positive integers" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["xl", "lcm"])
def test_sdxl_and_lcm_folders_are_served_with_each_requests_seed(tmp_path, kind):
    """The generator replica's class in this process (no Ray; its two steps, checking a request and running a
    batch): a batch of two requests gives each the image of a single call with its seed."""
    from dataclasses import asdict

    from optimum_iobinding.export import export_pipeline
    from optimum_iobinding.pipelines import pipeline_class_for
    from optimum_iobinding.serve import ImageGenerator, ServeConfig

    folder = export_pipeline(None, tmp_path / kind, tiny_random=kind, progress=False)
    config = ServeConfig(model=str(folder), device="cpu", max_batch_size=2, steps=2, warmup_batch_sizes=[])
    generator = ImageGenerator(asdict(config))
    size = generator.default_size
    requests = [
        dict(prompt=f"a cat {i}", negative_prompt=None, seed=10 + i, size=size, n=1, steps=None, guidance=None)
        for i in range(2)
    ]

    answers = generator.run_batch([generator.complete_request(request) for request in requests])
    assert [answer["batch_images"] for answer in answers] == [2, 2]  # batched into one call
    pipe = pipeline_class_for(folder).from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    for request, answer in zip(requests, answers):
        single = pipe(
            request["prompt"],
            height=size,
            width=size,
            num_inference_steps=2,
            guidance_scale=config.guidance,
            generator=torch.Generator().manual_seed(request["seed"]),
            output_type="np",
        ).images[0]
        expected = (np.clip(single, 0, 1) * 255).round().astype(np.uint8)
        assert np.abs(answer["images"][0].astype(int) - expected.astype(int)).max() <= 1
    if kind == "lcm":  # its guidance is an embedding: no negative prompt, refused by name
        with pytest.raises(ValueError, match="negative_prompt: OnnxLatentConsistencyModelPipeline takes none"):
            generator.complete_request(dict(requests[0], negative_prompt="blurry"))


def test_image_to_image_runs_on_the_pipelines_own_sibling_over_the_same_models(generator):
    """The replica asks the pipeline for its image-to-image sibling: it shares every model, no second copy."""
    from optimum_iobinding.families import family, family_of_class, pipeline_class

    assert generator.info()["image_to_image"] is True
    sibling = family(family_of_class(type(generator.pipe).__name__).image_to_image)
    assert type(generator.img2img) is pipeline_class(sibling)
    assert generator.img2img.unet is generator.pipe.unet and generator.img2img.vae_encoder is generator.pipe.vae_encoder


def test_inpainting_runs_on_the_pipelines_own_sibling_over_the_same_models(generator):
    from optimum_iobinding.families import family, family_of_class, pipeline_class

    assert generator.info()["inpainting"] is True
    sibling = family(family_of_class(type(generator.pipe).__name__).inpainting)
    assert type(generator.inpaint) is pipeline_class(sibling)
    assert generator.inpaint.unet is generator.pipe.unet and generator.inpaint.vae_encoder is generator.pipe.vae_encoder


def test_an_image_request_to_a_folder_without_a_vae_encoder_is_refused_by_name(tiny_folder, tmp_path):
    import shutil
    from dataclasses import asdict

    from optimum_iobinding.serve import ImageGenerator, ServeConfig

    folder = tmp_path / "no-encoder"
    shutil.copytree(tiny_folder, folder, ignore=shutil.ignore_patterns("vae_encoder"))
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps(dict(index, vae_encoder=[None, None])))
    generator = ImageGenerator(asdict(ServeConfig(model=str(folder), device="cpu", warmup_batch_sizes=[])))
    assert generator.img2img is None and generator.info()["image_to_image"] is False
    assert generator.inpaint is None and generator.info()["inpainting"] is False
    with pytest.raises(
        ValueError, match="image: OnnxStableDiffusionPipeline on this folder has no image-to-image pipeline"
    ):
        generator.complete_request(dict(prompt="a cat", image="unread"))
    with pytest.raises(ValueError, match="mask: OnnxStableDiffusionPipeline on this folder has no inpainting pipeline"):
        generator.complete_request(dict(prompt="a cat", image="unread", mask=b"unread"))


def test_a_missing_model_fails_the_replica_with_the_message_naming_it(tmp_path):
    from dataclasses import asdict

    from optimum_iobinding.serve import ImageGenerator, ServeConfig

    config = ServeConfig(model=str(tmp_path / "nowhere"), device="cpu")
    with pytest.raises(FileNotFoundError, match="expected an existing local folder or a hub repository id"):
        ImageGenerator(asdict(config))
