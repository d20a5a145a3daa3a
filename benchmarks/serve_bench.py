"""Serving benchmark: the Ray Serve application (``optimum_iobinding.serve``) under load, against the same
application serving diffusers' numpy ``OnnxStableDiffusionPipeline``, and the bare pipeline in one process.

For each engine × replica count × batching (on: ``max_batch_size`` images per call; off: 1), the app is deployed
on the local Ray cluster (replicas take a GPU each where there are GPUs) and ``optimum_iobinding.serve.loadtest``
measures images/s and p50/p95/p99 latency at each concurrency (a closed loop at steady state: one uncounted answer
per client, then the counted ones, without draining in between). Before Ray starts, a fresh process measures the
bare pipeline on one GPU: the batch-1 latency, its image's PNG size, and images/s at fixed batch sizes.

Serve's own floor is measured in the same run, through the same proxy at concurrency 1: a deployment that reads the
body, waits as long as the bare batch-1 call (its p50, on the event loop, as a replica waits for its pipeline call)
and answers as many bytes as that call's PNG (:func:`floor_app`). Its p50 less that wait is what Serve's HTTP path
costs on this machine; served c1 p50 − bare p50 − floor p50 is what the service adds beyond it: its handler,
batching and PNG (:func:`floor_summary`).

Writes ``serve.json`` (device, versions, command, every row, the floor), ``serve.md`` (the table, the floor, and the
ratios against their targets) and ``serve.png``.

    python benchmarks/serve_bench.py --folder WORK/sd15-fp16-optimized --out OUT/serve --replicas 1,2
"""

# no `from __future__ import annotations`: FastAPI reads the floor deployment's annotations as objects
import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "a photo of an astronaut riding a horse on mars"


def bare(folder: str, steps: int, size: int, batches, device: str, png_compression: int = 0) -> dict:
    import numpy as np
    import torch

    from optimum_iobinding.pipelines import pipeline_class_for
    from optimum_iobinding.serve.schema import encode_pngs

    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    pipe = pipeline_class_for(folder).from_pretrained(
        folder, provider="CUDAExecutionProvider" if cuda else "CPUExecutionProvider"
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.warmup(heights=size, batch_sizes=list(batches))

    images = []

    def seconds(batch: int) -> float:
        start = time.perf_counter()
        images[:] = pipe(
            [PROMPT] * batch,
            height=size,
            width=size,
            num_inference_steps=steps,
            generator=[torch.Generator().manual_seed(i) for i in range(batch)],
            output_type="np",
        ).images
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    latency = statistics.median(seconds(1) for _ in range(5))
    # the PNG the service answers for that image (as its replicas encode it): the size of the floor's answer
    pixels = (np.clip(np.asarray(images[0]), 0, 1) * 255).round().astype(np.uint8)
    png_bytes = len(encode_pngs([pixels], png_compression)[0])
    fixed = {}
    for batch in batches:
        median = statistics.median(seconds(batch) for _ in range(3))
        fixed[str(batch)] = {"seconds": median, "images_per_s": batch / median}
    return {"latency_batch1_s": latency, "png_bytes": png_bytes, "fixed_batches": fixed}


def floor_app(payload_bytes: int, wait_s: float, name: str = "ServeFloor"):
    """Ray Serve's floor for one request: a deployment (FastAPI through ``@serve.ingress``, as ``ImageService``; one
    CPU) whose ``POST /v1/images`` reads the body, waits ``wait_s`` with its event loop free (``asyncio.sleep``: a
    replica awaits its pipeline call the same way) and answers ``payload_bytes`` bytes as ``image/png``, with the
    service's ``X-Body-Seconds`` and ``X-Server-Seconds`` headers. What a client waits beyond ``wait_s`` is Serve's
    HTTP path alone: proxy, the hop to the replica and back, the body and the answer's bytes."""
    import os

    from fastapi import FastAPI, Request
    from fastapi.responses import Response
    from ray import serve

    api = FastAPI()
    payload = os.urandom(payload_bytes)  # the bytes of a PNG's size (stored PNGs hardly compress either)

    class Floor:
        @api.post("/v1/images")
        async def images(self, request: Request) -> Response:
            start = time.perf_counter()
            await request.body()
            body_s = time.perf_counter() - start
            await asyncio.sleep(wait_s)
            return Response(
                content=payload,
                media_type="image/png",
                headers={"X-Body-Seconds": f"{body_s:.6f}", "X-Server-Seconds": f"{time.perf_counter() - start:.6f}"},
            )

    deployment = serve.deployment(name=name, ray_actor_options={"num_cpus": 1})(serve.ingress(api)(Floor))
    return deployment.bind()


def floor_summary(result: dict) -> dict:
    """The floor's figures from a result (``bare``, ``floor``: its load-test row with ``wait_s``, and ``rows``): the
    floor's p50 less its wait (``overhead_p50_s``, Serve's own path), and for each concurrency-1 row of
    optimum-iobinding, served p50 − bare p50 − floor overhead p50 (``beyond_floor_s``: what the service adds to
    Serve's path). Empty where the floor or the bare latency is missing."""
    floor, bare_result = result.get("floor") or {}, result.get("bare") or {}
    if "p50_s" not in floor or "latency_batch1_s" not in bare_result:
        return {}
    overhead = floor["p50_s"] - floor["wait_s"]
    served = [
        {
            "replicas": row["replicas"],
            "batching": row["batching"],
            "p50_s": row["p50_s"],
            "beyond_floor_s": row["p50_s"] - bare_result["latency_batch1_s"] - overhead,
        }
        for row in result.get("rows", [])
        if row.get("engine") == "optimum-iobinding"
        and row.get("concurrency") == 1
        and not row.get("fresh")
        and "p50_s" in row
    ]
    return {"overhead_p50_s": overhead, "bare_p50_s": bare_result["latency_batch1_s"], "served_c1": served}


def measure_floor(url: str, payload_bytes: int, wait_s: float, requests: int, body: dict) -> dict:
    """The floor deployment (:func:`floor_app`) on the running Serve at ``url``'s root, loaded at concurrency 1 with
    ``requests`` counted answers of ``body`` (as the served rows); its row, with ``wait_s`` and ``payload_bytes``.
    The deployment is deleted afterwards."""
    from ray import serve

    from optimum_iobinding.serve.loadtest import run_loadtest

    serve.run(floor_app(payload_bytes, wait_s), name="floor", route_prefix="/", blocking=False)
    try:
        (row,) = run_loadtest(url, [1], requests, body)
    finally:
        serve.delete("floor")
    return {"wait_s": wait_s, "payload_bytes": payload_bytes, **row}


def versions() -> dict:
    found = {}
    for name in ("onnxruntime", "torch", "diffusers", "transformers", "ray"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            found[name] = None
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--replicas", default="1,2")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--requests", type=int, default=16, help="counted requests per level, at least")
    parser.add_argument(
        "--requests-per-client",
        type=int,
        default=4,
        help="a level counts max(--requests, this × concurrency) answers, at most --max-requests, "
        "after one uncounted answer per client (the loop does not drain in between)",
    )
    parser.add_argument("--max-requests", type=int, default=128)
    parser.add_argument("--png-compression", type=int, default=0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--batch-wait-ms", type=float, default=0.0)
    parser.add_argument("--engines", default="optimum-iobinding,diffusers-numpy")
    parser.add_argument("--numpy-batching", action="store_true", help="also run the numpy engine with batching")
    parser.add_argument("--batching", default="on,off", help="optimum-iobinding with batching on, off or both")
    parser.add_argument("--bare-batches", default="1,2,4,8")
    parser.add_argument(
        "--fresh-requests",
        type=int,
        default=64,
        help="right after each deployment is ready (its replicas warmed up), this many requests at "
        "--fresh-concurrency, every answer counted: what a user's first burst sees (0: skip)",
    )
    parser.add_argument("--fresh-concurrency", type=int, default=16)
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure Serve's own floor at concurrency 1 (a deployment that waits the bare call's p50 "
        "and answers its PNG's bytes); --no-floor skips it",
    )
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.batching or not set(args.batching.split(",")) <= {"on", "off"}:
        parser.error(f"--batching: expected on, off or on,off, got {args.batching!r}")
    batches = [int(b) for b in args.bare_batches.split(",")]
    if args.bare:
        print(
            "BARE " + json.dumps(bare(args.folder, args.steps, args.size, batches, args.device, args.png_compression)),
            flush=True,
        )
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--bare"], capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("BARE ")]
    bare_result = json.loads(lines[-1][5:]) if lines else {"error": done.stderr[-2000:]}
    print("bare:", bare_result, flush=True)

    from optimum_iobinding.serve.config import prepare_local_ray

    prepare_local_ray()  # the local cluster `optimum-iobinding serve` starts: on loopback, Serve's loop settings
    import ray
    from ray import serve

    from optimum_iobinding.serve.loadtest import run_loadtest
    from optimum_iobinding.serve import ServeConfig, build_app

    ray.init(log_to_driver=False, include_dashboard=False)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    url = f"http://127.0.0.1:{args.port}"
    levels = [int(c) for c in args.concurrency.split(",")]
    body = {"prompt": PROMPT, "seed": 0, "size": args.size, "steps": args.steps}
    floor = None
    if args.floor and "latency_batch1_s" in bare_result:  # as many counted answers as a served c1 level
        floor = measure_floor(
            url,
            bare_result["png_bytes"],
            bare_result["latency_batch1_s"],
            min(args.max_requests, max(args.requests, args.requests_per_client)),
            body,
        )
        print({"floor": {k: floor.get(k) for k in ("wait_s", "payload_bytes", "p50_s", "statuses")}}, flush=True)
    rows = []
    for engine in args.engines.split(","):
        for replicas in [int(r) for r in args.replicas.split(",")]:
            modes = (
                [mode == "on" for mode in args.batching.split(",")]
                if engine == "optimum-iobinding"
                else ([True, False] if args.numpy_batching else [False])
            )
            for batching in modes:
                batch = args.max_batch_size if batching else 1
                config = ServeConfig(
                    model=args.folder,
                    replicas=replicas,
                    max_batch_size=batch,
                    max_images_per_request=1,
                    batch_wait_timeout_s=args.batch_wait_ms / 1000,
                    steps=args.steps,
                    engine=engine,
                    device=args.device,
                    warmup_sizes=[args.size],
                    max_ongoing_requests=max(64, 2 * batch),
                    max_queued_requests=4096,
                    png_compression=args.png_compression,
                )
                start = time.perf_counter()
                try:
                    serve.run(build_app(config), name="bench", route_prefix="/", blocking=False)
                except Exception as error:  # noqa: BLE001 — recorded, the next configuration still runs
                    rows.append({"engine": engine, "replicas": replicas, "batching": batching, "error": str(error)})
                    print(rows[-1], flush=True)
                    serve.delete("bench")
                    continue
                ready_s = time.perf_counter() - start
                if args.fresh_requests and engine == "optimum-iobinding":
                    (result,) = run_loadtest(url, [args.fresh_concurrency], args.fresh_requests, body, warmup=0)
                    rows.append(
                        {
                            "engine": engine,
                            "replicas": replicas,
                            "batching": batching,
                            "fresh": True,
                            "max_batch_size": batch,
                            "ready_s": ready_s,
                            **result,
                        }
                    )
                    print(
                        {
                            k: rows[-1][k]
                            for k in (
                                "engine",
                                "replicas",
                                "batching",
                                "fresh",
                                "concurrency",
                                "images_per_s",
                                "p50_s",
                                "statuses",
                            )
                        },
                        flush=True,
                    )
                for level in levels:
                    requests = min(args.max_requests, max(args.requests, args.requests_per_client * level))
                    (result,) = run_loadtest(url, [level], requests, body)
                    rows.append(
                        {
                            "engine": engine,
                            "replicas": replicas,
                            "batching": batching,
                            "max_batch_size": batch,
                            "ready_s": ready_s,
                            **result,
                        }
                    )
                    print(
                        {
                            k: rows[-1][k]
                            for k in (
                                "engine",
                                "replicas",
                                "batching",
                                "concurrency",
                                "images_per_s",
                                "p50_s",
                                "p99_s",
                                "statuses",
                            )
                        },
                        flush=True,
                    )
                serve.delete("bench")
    serve.shutdown()
    ray.shutdown()
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    result = {
        "device": device,
        "gpus": gpus,
        "versions": versions(),
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "steps": args.steps,
        "size": args.size,
        "bare": bare_result,
        "rows": rows,
        "floor": floor,
    }
    result["floor_summary"] = floor_summary(result)
    (out / "serve.json").write_text(json.dumps(result, indent=2))
    (out / "serve.md").write_text(report(result))
    plot(result, out / "serve.png")
    print(report(result))
    return 0


def _row(rows, engine, replicas, batching, concurrency):
    for row in rows:
        if (
            (row.get("engine"), row.get("replicas"), row.get("batching"), row.get("concurrency"))
            == (engine, replicas, batching, concurrency)
            and "images_per_s" in row
            and not row.get("fresh")
        ):
            return row
    return None


def report(result: dict) -> str:
    lines = [
        f"# Serving: {result['device']} × {result['gpus']}",
        "",
        f"`{result['command']}` — {result['date']}; {result['versions']}; {result['size']}², {result['steps']} steps",
        "",
        "Mean ms: the client's latency, then the service's own account of it (`X-Server-Seconds` in the replica's "
        "HTTP handler ⊃ `X-Replica-Seconds` waiting for and riding in a batch ⊃ `X-Pipeline-Seconds`, the "
        "pipeline call); then, also in the handler, reading the body from Serve's proxy (`X-Body-Seconds`) and "
        "encoding the PNGs (`X-Encode-Seconds`; within the batch's time for stored PNGs, `--png-compression 0`).",
        "",
        "| engine | replicas | batching | concurrency | images/s | p50 ms | p99 ms | mean ms: client / server / "
        "replica / pipeline | mean ms: body / encode | statuses | batch images |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        if "error" in row:
            lines.append(
                f"| {row['engine']} | {row['replicas']} | {row['batching']} | | error: {row['error'][:80]} "
                "| | | | | | |"
            )
            continue
        means = " / ".join(
            "" if row.get(key) is None else f"{row[key] * 1000:.0f}"
            for key in ("mean_s", "server_mean_s", "replica_mean_s", "pipeline_mean_s")
        )
        handler = " / ".join(
            "" if row.get(key) is None else f"{row[key] * 1000:.1f}" for key in ("body_mean_s", "encode_mean_s")
        )
        lines.append(
            f"| {row['engine']} | {row['replicas']} | {'on' if row['batching'] else 'off'} | "
            f"{row['concurrency']}{' (fresh)' if row.get('fresh') else ''} | {row['images_per_s']:.2f} | {row['p50_s'] * 1000:.0f} | "
            f"{row['p99_s'] * 1000:.0f} | {means} | {handler} | {row['statuses']} | {row['batch_images']} |"
        )
    bare_result = result["bare"]
    rows = result["rows"]
    lines += ["", f"Bare pipeline (one process, one GPU): {json.dumps(bare_result)}", ""]
    lines += floor_lines(result)
    ours = "optimum-iobinding"
    checks = []
    one, two = _row(rows, ours, 1, True, 16), _row(rows, ours, 2, True, 16)
    if one and two:
        checks.append(
            f"two replicas / one at concurrency 16 (batching): "
            f"{two['images_per_s'] / one['images_per_s']:.3f} (target ≥ 1.9)"
        )
    anchor = _row(rows, "diffusers-numpy", 1, False, 16)
    if one and anchor:
        checks.append(
            f"per GPU vs the numpy deployment at concurrency 16: "
            f"{one['images_per_s'] / anchor['images_per_s']:.3f} (target ≥ 1.5)"
        )
    single = _row(rows, ours, 1, True, 1) or _row(rows, ours, 1, False, 1)
    if single and "latency_batch1_s" in bare_result:
        checks.append(
            f"concurrency 1 p50 / bare latency: {single['p50_s'] / bare_result['latency_batch1_s']:.3f} "
            "(Serve's own path included: the floor above is the target's measure)"
        )
    if one and "fixed_batches" in bare_result:
        best = max(v["images_per_s"] for v in bare_result["fixed_batches"].values())
        checks.append(
            f"batching at concurrency 16 / best fixed batch of the bare pipeline: "
            f"{one['images_per_s'] / best:.3f} (target ≥ 1.0)"
        )
        fresh = next(
            (
                row
                for row in rows
                if row.get("fresh")
                and row["engine"] == ours
                and row["replicas"] == 1
                and row["batching"]
                and "images_per_s" in row
            ),
            None,
        )
        if fresh:
            checks.append(
                f"a fresh server's first {fresh['requests']} requests at concurrency "
                f"{fresh['concurrency']} / best fixed batch of the bare pipeline: "
                f"{fresh['images_per_s'] / best:.3f} (target ≥ 0.95)"
            )
    lines += [f"- {check}" for check in checks]
    return "\n".join(lines) + "\n"


def floor_lines(result: dict) -> list:
    """The report's lines on Serve's floor (none where it was not measured)."""
    floor, summary = result.get("floor"), floor_summary(result)
    if not floor or "p50_s" not in floor:
        return []
    lines = [
        f"Serve's floor at concurrency 1 (a deployment that reads the body, waits {floor['wait_s'] * 1000:.1f} ms "
        f"— the bare call's p50 — and answers {floor['payload_bytes']} bytes, through the same proxy): p50 "
        f"{floor['p50_s'] * 1000:.1f} ms, **{summary['overhead_p50_s'] * 1000:.1f} ms** beyond its wait "
        f"(statuses {floor['statuses']})."
    ]
    for row in summary["served_c1"]:
        lines.append(
            f"- served c1 p50 − bare p50 − floor p50 ({row['replicas']} replica(s), batching "
            f"{'on' if row['batching'] else 'off'}): {row['p50_s'] * 1000:.1f} − "
            f"{summary['bare_p50_s'] * 1000:.1f} − {summary['overhead_p50_s'] * 1000:.1f} = "
            f"**{row['beyond_floor_s'] * 1000:.1f} ms** (the service's handler, batching and PNG beyond "
            "Serve's path; target ≤ 5 ms)"
        )
    return lines + [""]


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    series = {}
    for row in result["rows"]:
        if "images_per_s" not in row:
            continue
        key = f"{row['engine']}, {row['replicas']} replica(s), batching {'on' if row['batching'] else 'off'}"
        series.setdefault(key, []).append(row)
    for key, rows in series.items():
        levels = [r["concurrency"] for r in rows]
        left.plot(levels, [r["images_per_s"] for r in rows], marker="o", label=key)
        right.plot(levels, [r["p99_s"] * 1000 for r in rows], marker="o", label=key)
    for axis, label in ((left, "images/s"), (right, "p99 latency ms")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrency")
        axis.set_ylabel(label)
    left.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
