"""``optimum-iobinding bench``: its command line, and the orchestration of a run — every peer of every (model,
dtype, export) in a process of its own, then the report.

The same ONNX files go through every ONNX peer (:mod:`.peers`), plus diffusers' torch pipeline, on one GPU in one
run. Each peer runs in its own process, so that memory and ORT arenas do not mix, and so that optimum-onnx can run
in its own environment (pass its site folder with ``--optimum-pythonpath``). Beside the peers, ``floor`` (not a
pipeline: back-to-back CUDA-graph replays of the UNet alone, :func:`.probes.run_floor`) gives the GPU floor of one
step.

Reported per pipeline (:mod:`.report`): end-to-end ms (median of ``--runs`` after ``--warmup``), per-step ms
((median at N steps − median at the short step count) / the steps between: the loop alone), for ours also the GPU's
time per step inside whole calls (CUDA events at the first and the last step) and their UNet graph replayed alone in
the same process, peak GPU memory above the process's idle (device-wide, sampled every millisecond by a child process
through NVML where pynvml is installed, so ORT's arenas count), host↔device bytes per step (profiled: (bytes at 4
steps − bytes at 2 steps) / 2), the largest pixel difference from the numpy pipeline's image, and the cold start:
seconds to load the pipeline (its imports timed apart, as ``import_s``) and seconds for its first image (fresh
process).
``--repeats N`` runs each peer in N processes, the peer order rotated each time, and reports the median over them
(host-bound loops move from one process to the next on the same machine).

``--cache SPEC`` (the single and the transformer scenarios) adds the row ``cached``: our default pipeline with
``pipe.enable_cache(cache_config_of(SPEC))`` (DeepCache ``deepcache:INTERVAL[:BRANCH]`` for the UNets, First-Block
Cache ``fbc:THRESHOLD`` for the transformers), measured as the others are, beside the uncached one (``defaults``,
``ours``) on the same files (the UNets' step-cache export, ``…-step-cache``, for every peer of the configuration);
it also reports which steps of its timed call at the full step count ran the whole model (``computed``), how many
it skipped, and its speed-up over the uncached row end to end (``speedup_vs_uncached``). No other peer caches.

``--scenario mixed`` is a service's load instead: batch sizes 1, 4, 8, 2 in turn (``--mixed-batches``), ``--mixed-
steps`` steps each, for ``--rounds`` rounds of ``--cycles`` passes over them: per round and batch size the median
ms of its calls, device memory, sessions created after the first round; the peer ``warmed`` is "defaults" with
``pipe.warmup(...)`` for those batch sizes after loading.

``--scenario stream`` is real-time image to image instead (:func:`stream_benchmark`): the turbo architecture at 512²,
batch 1, fused fp16 (or the first of ``--dtypes``/``--exports`` where given), its full VAE and a TAESD-shaped tiny
VAE, 1 step and 2 steps (stream batch on and off); per peer (:data:`.peers.STREAM_PEERS`) per-frame latency
p50/p99 and frames/s over ``--frames`` frames, the floor of the components' graphs, and a ``--video-frames`` video
through the ``stream`` command; results in stream.json/md/png. After them the feature rows (``--stream-features``,
comma-separated names of :data:`STREAM_FEATURES`, default all of them, ``none`` for none), each at 1 step with the
tiny VAE and measured by ours and the floor alone (the floor at the shapes the row prepares): guidance 1.5,
classifier-free (``full-cfg``) and StreamDiffusion's residual guidance (``rcfg-self``, ``rcfg-initialize``); the
similarity filter at 0.98 on a still clip and on a moving one (``filter-still``, ``filter-moving``; the share of
frames it skipped); one ControlNet with a fixed control image or one given with each frame (``controlnet``,
``controlnet-per-frame``), on an export of the turbo architecture with a random ControlNet
(:func:`.zoo.ensure_controlnet_export`, under ``--work`` beside the others); one IP-Adapter (random weights, 4 image
tokens, scale 1) with a fixed image prompt or a new one before each frame (``ip-adapter``, ``ip-adapter-per-frame``;
the mean time of ``update_image_prompt`` alone), on an export of the turbo architecture for IP-Adapter with a random
image encoder of ViT-H/14's shape (:func:`.zoo.ensure_ip_adapter_export`, under ``--work`` too).

    optimum-iobinding bench --models tiny,small,sd15 --dtypes fp16 --exports plain,optimized --out benchmarks/results/h100
``--scenario transformer`` measures SD3.5 Medium's and FLUX.1's architectures (:mod:`.transformer_peers`) at 1024²,
batch 1, each at its recipe (:data:`.zoo.TRANSFORMER_RECIPES`), fused fp16 (or the first of ``--dtypes``/
``--exports``; ``--dtypes bf16``, this scenario's alone, exports the transformer in bfloat16): ours, optimum-onnx on
the same folder, diffusers' torch pipeline in bf16, the same with ``torch.compile`` (``--compile-timeout``) and the
floor of our transformer's CUDA graph; ``--blocks N`` builds the transformers with fewer blocks (every row says so),
``--text-layers N`` shallower text encoders. Results in transformer.json/md/png.

``--scenario video`` measures Wan 2.1 T2V 1.3B's architecture (:mod:`.video_peers`) at its model card's recipe
(480 × 832, 81 frames, guidance 5; ``--steps`` of its 50 steps, default 4), fused fp16 (``--dtypes bf16``: a bfloat16
transformer): ours, diffusers' torch WanPipeline (bf16, VAE float32), the same with ``torch.compile``
(``--compile-mode``) and the floor of our transformer's CUDA graph; per peer end to end, per step, the VAE decode of
the 81 frames, peak memory. A second table: the MLPerf Inference v6.0 shape, Wan 2.2 T2V A14B's transformer with
``--mlperf-blocks`` of its 40 blocks at 720 × 1280, one guided step (``--mlperf-peers``). The exports run on the
CPUs beside the GPU while the peers that need none (diffusers') measure. ``--tiny`` runs all of it on the tiny Wan
model (on the CPU unless ``--device cuda``). Results in video.json/md/png.

    optimum-iobinding bench --models tiny,small,sd15 --dtypes fp16 --exports plain,optimized --out benchmarks/results/h100
    optimum-iobinding bench --scenario stream --dtypes fp16 --exports optimized --out benchmarks/results/h100/stream
    optimum-iobinding bench --scenario stream --peers ours,floor --stream-features rcfg-self,filter-still --out OUT
    optimum-iobinding bench --scenario transformer --models sd35m,flux-schnell --out benchmarks/results/h100/transformer
    optimum-iobinding bench --scenario video --steps 4 --out benchmarks/results/h200/video
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..cache_spec import parse_cache_spec
from ..errors import DEBUG_HELP, PROGRAM, ArgumentError, CommandLineParser, quiet_libraries, unrecognized_arguments
from .peers import (
    CACHED_PEER,
    MIXED_PEERS,
    OPTIMUM_PEERS,
    OUR_PEERS,
    PEERS,
    STREAM_BATCH_BLIND,
    STREAM_FEATURE_PEERS,
    STREAM_KIND,
    STREAM_PEERS,
    STREAM_SIZE,
    UNCACHED_PEER,
    PeerUnavailable,
    run_mixed,
    run_peer,
    run_stream_peer,
    stream_unet_steps,
)
from .coldstart import COLDSTART_MODELS, coldstart_benchmark, write_coldstart_report
from .probes import environment, run_floor
from .report import (
    combine_repeats,
    stream_row_label,
    write_mixed_report,
    write_report,
    write_stream_report,
    write_transformer_report,
    write_video_report,
)
from .transformer_peers import (
    CACHED_TRANSFORMER_PEER,
    OPTIMUM_TRANSFORMER_PEERS,
    OUR_TRANSFORMER_PEERS,
    TRANSFORMER_PEERS,
    UNCACHED_TRANSFORMER_PEER,
    run_transformer_floor,
    run_transformer_peer,
)
from .video_peers import (
    COMPILE_MODES,
    CPU_VIDEO_PEERS,
    MLPERF_PEERS,
    OUR_VIDEO_PEERS,
    VIDEO_PEERS,
    run_mlperf_peer,
    run_video_floor,
    run_video_peer,
)
from .zoo import (
    IP_ADAPTER_TOKENS,
    MLPERF_VIDEO_RECIPES,
    MODEL_SIZES,
    TRANSFORMER_BLOCKS,
    TRANSFORMER_RECIPES,
    VIDEO_RECIPES,
    VIDEO_TEXT_LAYERS,
    ensure_controlnet_export,
    ensure_export,
    ensure_ip_adapter_export,
    ensure_mlperf_export,
    ensure_tiny_vae_export,
    ensure_transformer_export,
    ensure_video_export,
    transformer_blocks,
    wan_blocks,
    wan_full_blocks,
)

# the stream scenario's configurations: (num_inference_steps, strength, stream batch), each with both VAEs
STREAM_CONFIGS = ((2, 0.5, True), (4, 0.5, True), (4, 0.5, False))
STREAM_VAES = ("full", "tiny")
# the stream scenario's feature rows (--stream-features), after the configurations: name → what the row prepares and
# feeds, each on the first configuration (1 UNet step) with the tiny VAE. Guidance 1.5 classifier-free ("full": a
# negative-prompt row beside the latent's) and StreamDiffusion's residual guidance ("self": no extra row;
# "initialize": one negative row); the similarity filter on a still clip (one frame again and again: what it skips)
# and on a moving one (every frame new: what deciding costs a frame it keeps); one ControlNet with one control image
# for every frame ("fixed") or one given with each frame ("per-frame"); one IP-Adapter (random weights, its image
# tokens and scale) with one image prompt for every frame ("fixed") or a new one before each frame ("per-frame":
# ``update_image_prompt``). ``clip``: the frames fed.
STREAM_FEATURES: Dict[str, Dict[str, Any]] = {
    "full-cfg": {"guidance_scale": 1.5, "cfg_type": "full", "clip": "moving"},
    "rcfg-self": {"guidance_scale": 1.5, "cfg_type": "self", "clip": "moving"},
    "rcfg-initialize": {"guidance_scale": 1.5, "cfg_type": "initialize", "clip": "moving"},
    "filter-still": {"similarity_threshold": 0.98, "clip": "still"},
    "filter-moving": {"similarity_threshold": 0.98, "clip": "moving"},
    "controlnet": {"controlnets": 1, "control": "fixed", "clip": "moving"},
    "controlnet-per-frame": {"controlnets": 1, "control": "per-frame", "clip": "moving"},
    "ip-adapter": {
        "ip_adapter_tokens": IP_ADAPTER_TOKENS,
        "ip_adapter_scale": 1.0,
        "image_prompt": "fixed",
        "clip": "moving",
    },
    "ip-adapter-per-frame": {
        "ip_adapter_tokens": IP_ADAPTER_TOKENS,
        "ip_adapter_scale": 1.0,
        "image_prompt": "per-frame",
        "clip": "moving",
    },
}
STREAM_FEATURE_VAE = "tiny"

# the transformer scenario's models where --models is not given
TRANSFORMER_DEFAULT_MODELS = ("sd35m", "flux-schnell", "flux-dev")
# the scenarios that take --cache, each with the cache form its models take, the models' family, and the other
# scenario's cache (the hint of a refusal)
CACHE_SCENARIOS = {
    "single": (
        "deepcache",
        "deepcache:INTERVAL[:BRANCH] (DeepCache)",
        "the UNets",
        "First-Block Cache (fbc) is SD3's and FLUX.1's: --scenario transformer",
    ),
    "transformer": (
        "fbc",
        "fbc:THRESHOLD (First-Block Cache)",
        "the diffusion transformers",
        "DeepCache (deepcache) is the UNets': --scenario single",
    ),
}

# what --help says the benchmark is
DESCRIPTION = (
    "Benchmark: the same ONNX files through every ONNX peer, plus diffusers' torch pipeline, on one GPU in one run."
)


def run_in_subprocess(
    args: List[str],
    pythonpath: Optional[str],
    timeout: int,
    cpus: Optional[Sequence[int]] = None,
    environ: Optional[Dict[str, str]] = None,
) -> Dict[str, Any]:
    """``python -m optimum_iobinding.bench ARGS --result FILE`` in a fresh process (``pythonpath`` put first on its
    PYTHONPATH; ``cpus``: the only CPUs it runs on, where the system can pin a process; ``environ``: variables set for
    it), and the JSON it wrote; ``{"error": ...}`` with the end of its output where it failed or ran past ``timeout``
    seconds."""
    pin = None
    if cpus and hasattr(os, "sched_setaffinity"):
        pin = lambda: os.sched_setaffinity(0, set(cpus))  # noqa: E731 — in the child, before it starts Python
    env = {**os.environ, **(environ or {})}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as result_file:
        result_path = result_file.name
    try:
        completed = subprocess.run(
            [sys.executable, "-m", "optimum_iobinding.bench", *args, "--result", result_path],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=pin,
        )
        if completed.returncode != 0:
            return {"error": (completed.stderr or completed.stdout)[-2000:]}
        return json.loads(Path(result_path).read_text())
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    finally:
        os.unlink(result_path)


def with_cached_peer(peers: Sequence[str], uncached: str, cached: str, cache: Optional[str]) -> List[str]:
    """``peers`` with ``cached`` right after ``uncached`` where a step cache is given (``cache``), else as they
    are."""
    if cache is None:
        return list(peers)
    return [name for peer in peers for name in ((peer, cached) if peer == uncached else (peer,))]


def compare_cached(peers: Dict[str, Dict[str, Any]], uncached: str, cached: str) -> None:
    """The cached row's speed-up end to end over the uncached row of the same run and files
    (``speedup_vs_uncached``: uncached ms ÷ cached ms), where both were measured."""
    plain, result = peers.get(uncached, {}), peers.get(cached, {})
    if plain.get("end_to_end_ms") and result.get("end_to_end_ms"):
        result["speedup_vs_uncached"] = plain["end_to_end_ms"] / result["end_to_end_ms"]


def benchmark(
    models: Sequence[str],
    dtypes: Sequence[str],
    exports: Sequence[str],
    peers: Sequence[str],
    steps: int,
    runs: int,
    warmup: int,
    work: Path,
    out: Path,
    optimum_pythonpath: Optional[str],
    timeout: int,
    repeats: int = 1,
    cache: Optional[str] = None,
) -> Dict:
    """Every peer of every (model, dtype, export), each in a process of its own, ``repeats`` times: repeat ``r``
    runs the peers in the given order rotated by ``r``, so that no peer always follows the same one (host-bound
    loops move between processes on the same machine), and the table shows the median over the processes
    (:func:`.report.combine_repeats`). With ``cache`` (a ``--cache`` spec), every peer runs on the step-cache export
    (so that "defaults" and "cached" read the same ``model.onnx``) and "cached" runs right after "defaults"
    (:func:`compare_cached`)."""
    from tqdm.auto import tqdm

    if repeats < 1:
        raise ArgumentError("repeats", f"expected at least 1, got {repeats}")
    out.mkdir(parents=True, exist_ok=True)
    results: Dict[str, Any] = {
        "environment": environment(),
        "steps": steps,
        "runs": runs,
        "warmup": warmup,
        "repeats": repeats,
        "cache": cache,
        "rows": [],
    }
    peers = with_cached_peer(peers, UNCACHED_PEER, CACHED_PEER, cache)
    configs = [(m, d, e) for m in models for d in dtypes for e in exports]
    progress = tqdm(total=len(configs) * (len(peers) * repeats + 2), desc="bench", unit="task")
    for kind, dtype, export in configs:
        progress.set_postfix_str(f"{kind} {dtype} {export}: export")
        folder = ensure_export(kind, dtype, export, work, step_cache=cache is not None)
        progress.update()
        row = {"model": kind, "dtype": dtype, "export": export, "size": MODEL_SIZES[kind], "peers": {}}
        floor_args = ["--run-floor", "--folder", str(folder), "--model", kind]
        progress.set_postfix_str(f"{kind} {dtype} {export}: floor")
        row["floor"] = run_in_subprocess(floor_args, None, timeout)
        progress.update()
        by_peer: Dict[str, List[Dict[str, Any]]] = {}
        for repeat in range(repeats):
            for peer in list(peers[repeat % len(peers) :]) + list(peers[: repeat % len(peers)]):
                if peer == "torch" and (dtype != "fp16" or export != "plain"):
                    progress.update()
                    continue  # the torch peer is fp16 eager, once per model
                progress.set_postfix_str(
                    f"{kind} {dtype} {export}: {peer}" + (f" ({repeat + 1}/{repeats})" if repeats > 1 else "")
                )
                image = work / f"image-{kind}-{dtype}-{export}-{peer}.npy"
                peer_args = [
                    "--run-peer",
                    peer,
                    "--folder",
                    str(folder),
                    "--model",
                    kind,
                    "--dtype",
                    dtype,
                    "--steps",
                    str(steps),
                    "--runs",
                    str(runs),
                    "--warmup",
                    str(warmup),
                    "--image",
                    str(image),
                    *(["--cache", cache] if peer == CACHED_PEER else []),
                ]
                by_peer.setdefault(peer, []).append(
                    run_in_subprocess(peer_args, optimum_pythonpath if peer in OPTIMUM_PEERS else None, timeout)
                )
                progress.update()
        row["peers"] = {peer: combine_repeats(by_peer[peer]) for peer in peers if peer in by_peer}
        compare_cached(row["peers"], UNCACHED_PEER, CACHED_PEER)
        reference = row["peers"].get("numpy", {}).get("image") or row["peers"].get("optimum", {}).get("image")
        row["reference"] = "numpy" if row["peers"].get("numpy", {}).get("image") else "optimum"
        for result in row["peers"].values():
            if reference and result.get("image") and "error" not in result:
                difference = np.abs(np.load(result["image"]) - np.load(reference)).max()
                result["max_abs_diff_vs_numpy"] = float(difference)
        results["rows"].append(row)
        (out / "results.json").write_text(json.dumps(results, indent=2))
    progress.close()
    write_report(results, out)
    return results


def mixed_benchmark(
    models: Sequence[str],
    dtypes: Sequence[str],
    exports: Sequence[str],
    peers: Sequence[str],
    batches: Sequence[int],
    steps: int,
    rounds: int,
    first_steps: int,
    work: Path,
    out: Path,
    timeout: int,
    cycles: int = 1,
) -> Dict:
    """``--scenario mixed``: every peer in a fresh process on the same export, results in mixed.json/md/png."""
    if cycles < 1:
        raise ArgumentError("cycles", f"expected at least 1, got {cycles}")
    out.mkdir(parents=True, exist_ok=True)
    results: Dict[str, Any] = {
        "environment": environment(),
        "scenario": "mixed",
        "batches": list(batches),
        "steps": steps,
        "rounds": rounds,
        "cycles": cycles,
        "first_steps": first_steps,
        "rows": [],
    }
    for kind, dtype, export in [(m, d, e) for m in models for d in dtypes for e in exports]:
        folder = ensure_export(kind, dtype, export, work)
        row = {"model": kind, "dtype": dtype, "export": export, "size": MODEL_SIZES[kind], "peers": {}}
        for peer in peers:
            print(f"mixed: {kind} {dtype} {export}: {peer}", file=sys.stderr, flush=True)
            row["peers"][peer] = run_in_subprocess(
                [
                    "--run-mixed",
                    peer,
                    "--folder",
                    str(folder),
                    "--model",
                    kind,
                    "--dtype",
                    dtype,
                    "--mixed-batches",
                    ",".join(map(str, batches)),
                    "--mixed-steps",
                    str(steps),
                    "--rounds",
                    str(rounds),
                    "--cycles",
                    str(cycles),
                    "--steps",
                    str(first_steps),
                ],
                None,
                timeout,
            )
        results["rows"].append(row)
        (out / "mixed.json").write_text(json.dumps(results, indent=2))
    write_mixed_report(results, out)
    return results


def stream_rows(features: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """The stream scenario's rows, in order: each configuration of :data:`STREAM_CONFIGS` with each VAE, then each
    of ``features`` (names of :data:`STREAM_FEATURES`, in that order) on the first configuration with the tiny VAE,
    its name as ``feature`` and its settings beside the configuration's."""
    rows = [
        {
            "steps": steps,
            "strength": strength,
            "stream_batch": stream_batch,
            "vae": vae,
            "unet_steps": stream_unet_steps(steps, strength),
            "peers": {},
        }
        for steps, strength, stream_batch in STREAM_CONFIGS
        for vae in STREAM_VAES
    ]
    unknown = [name for name in features if name not in STREAM_FEATURES]
    if unknown:
        raise ArgumentError("features", f"expected names among {', '.join(STREAM_FEATURES)}, got {unknown}")
    steps, strength, stream_batch = STREAM_CONFIGS[0]
    for name in (name for name in STREAM_FEATURES if name in features):
        rows.append(
            {
                "steps": steps,
                "strength": strength,
                "stream_batch": stream_batch,
                "vae": STREAM_FEATURE_VAE,
                "unet_steps": stream_unet_steps(steps, strength),
                "feature": name,
                **STREAM_FEATURES[name],
                "peers": {},
            }
        )
    return rows


def stream_config(row: Dict[str, Any]) -> Dict[str, Any]:
    """What a peer's process is told of ``row`` (``--stream-config``): the row without its results."""
    return {key: value for key, value in row.items() if key not in ("peers", "unet_steps")}


def stream_benchmark(
    peers: Sequence[str],
    dtype: str,
    export: str,
    frames: int,
    video_frames: int,
    warmup: int,
    work: Path,
    out: Path,
    timeout: int,
    run: Any = run_in_subprocess,
    features: Sequence[str] = (),
) -> Dict[str, Any]:
    """``--scenario stream``: every peer of every row (:func:`stream_rows`, with the feature rows ``features``) in a
    process of its own (``run``, :func:`run_in_subprocess`); a peer that fails has its error in its row and the others
    go on. The numpy and torch peers, whose work the stream batch does not change, run once per step count and VAE
    (the row without the stream batch shows the same result, ``measured_in`` naming the row); the video runs on the
    1-step rows; a feature row is measured by :data:`.peers.STREAM_FEATURE_PEERS` alone (a ControlNet row on the
    export with its ControlNets, :func:`.zoo.ensure_controlnet_export`, an IP-Adapter row on the export for
    IP-Adapter, :func:`.zoo.ensure_ip_adapter_export`, each made when the first such row comes). A row none of whose
    peers is among ``peers`` is left out. stream.json is rewritten after every row, stream.md/png at the
    end."""
    out.mkdir(parents=True, exist_ok=True)
    results: Dict[str, Any] = {
        "environment": environment(),
        "scenario": "stream",
        "model": STREAM_KIND,
        "size": STREAM_SIZE,
        "dtype": dtype,
        "export": export,
        "frames": frames,
        "video_frames": video_frames,
        "warmup": warmup,
        "rows": [],
    }
    folder = ensure_export(STREAM_KIND, dtype, export, work)
    try:
        tiny_vae: Optional[Path] = ensure_tiny_vae_export(dtype, export, work)
        tiny_error = None
    except Exception as error:  # noqa: BLE001 — the full-VAE rows still run
        tiny_vae, tiny_error = None, f"the tiny VAE export failed: {type(error).__name__}: {error}"
    controlnet_folders: Dict[int, Any] = {}  # ControlNets → the export's folder, or why it failed
    ip_adapter_folder: Any = None  # the export for IP-Adapter's folder, or why it failed; None: not made yet
    measured: Dict[Any, Dict[str, Any]] = {}
    for row in stream_rows(features):
        label = stream_row_label(row)
        config = stream_config(row)
        row_peers = [peer for peer in peers if "feature" not in row or peer in STREAM_FEATURE_PEERS]
        if not row_peers:
            continue
        row_folder: Any = folder
        if row.get("controlnets") and tiny_vae is not None:
            count = row["controlnets"]
            if count not in controlnet_folders:
                try:
                    controlnet_folders[count] = ensure_controlnet_export(STREAM_KIND, dtype, export, work, count)
                except Exception as error:  # noqa: BLE001 — the other rows still run
                    controlnet_folders[count] = f"the ControlNet export failed: {type(error).__name__}: {error}"
            row_folder = controlnet_folders[count]
        if row.get("image_prompt") and tiny_vae is not None:
            if ip_adapter_folder is None:
                try:
                    ip_adapter_folder = ensure_ip_adapter_export(STREAM_KIND, dtype, export, work)
                except Exception as error:  # noqa: BLE001 — the other rows still run
                    ip_adapter_folder = f"the IP-Adapter export failed: {type(error).__name__}: {error}"
            row_folder = ip_adapter_folder
        for peer in row_peers:
            if peer == "video" and row["unet_steps"] != 1:
                continue
            if row["vae"] == "tiny" and tiny_vae is None:
                row["peers"][peer] = {"peer": peer, "error": tiny_error}
                continue
            if isinstance(row_folder, str):
                row["peers"][peer] = {"peer": peer, "error": row_folder}
                continue
            key = (peer, row["steps"], row["strength"], row["vae"])
            if peer in STREAM_BATCH_BLIND and key in measured:
                row["peers"][peer] = measured[key]
                continue
            print(f"stream: {label}: {peer}", file=sys.stderr, flush=True)
            args = [
                "--run-stream",
                peer,
                "--folder",
                str(row_folder),
                "--stream-config",
                json.dumps(config),
                "--frames",
                str(video_frames if peer == "video" else frames),
                "--frame-warmup",
                str(warmup),
                "--work",
                str(work),
            ] + (["--tiny-vae-folder", str(tiny_vae)] if row["vae"] == "tiny" else [])
            result = run(args, None, timeout)
            row["peers"][peer] = result
            if peer in STREAM_BATCH_BLIND:
                measured[key] = {**result, "measured_in": label}
        results["rows"].append(row)
        (out / "stream.json").write_text(json.dumps(results, indent=2))
    write_stream_report(results, out)
    return results


def transformer_benchmark(
    models: Sequence[str],
    peers: Sequence[str],
    dtype: str,
    export: str,
    blocks: Optional[int],
    text_layers: Optional[int],
    runs: int,
    warmup: int,
    device: str,
    work: Path,
    out: Path,
    optimum_pythonpath: Optional[str],
    timeout: int,
    compile_timeout: int,
    cache: Optional[str] = None,
    run: Any = run_in_subprocess,
) -> Dict[str, Any]:
    """``--scenario transformer``: per model one export for ``device`` (:func:`.zoo.ensure_transformer_export`: an
    optimized export for the CPU has only the fusions the CPU runs; with First-Block Cache's parts), then every peer
    in a process of its own (``run``, :func:`run_in_subprocess`; optimum's in its environment); a peer that fails has
    its error in its row and the others go on, a ``compile`` peer past ``compile_timeout`` seconds is skipped as "did
    not compile". With ``cache`` (a ``--cache`` spec) "cached" runs right after "ours" on the same folder
    (:func:`compare_cached`). Images are compared with ours where the weights are the export's. transformer.json is
    rewritten after every peer, transformer.md/png at the end."""
    out.mkdir(parents=True, exist_ok=True)
    results: Dict[str, Any] = {
        "environment": environment(),
        "scenario": "transformer",
        "dtype": dtype,
        "export": export,
        "blocks": blocks,
        "text_layers": text_layers,
        "runs": runs,
        "warmup": warmup,
        "device": device,
        "cache": cache,
        "rows": [],
    }
    peers = with_cached_peer(peers, UNCACHED_TRANSFORMER_PEER, CACHED_TRANSFORMER_PEER, cache)
    for kind in models:
        recipe = TRANSFORMER_RECIPES[kind]
        depth = transformer_blocks(kind, blocks)
        row: Dict[str, Any] = {
            "model": kind,
            **recipe,
            "blocks": list(depth) if depth else None,
            "text_layers": None if kind.startswith("tiny") else text_layers,
            "peers": {},
        }
        results["rows"].append(row)
        print(f"transformer: {kind}: export", file=sys.stderr, flush=True)
        try:
            folder = ensure_transformer_export(kind, dtype, export, work, blocks, text_layers, device=device)
        except Exception as error:  # noqa: BLE001 — the next model still runs
            row["export_error"] = f"{type(error).__name__}: {error}"
            (out / "transformer.json").write_text(json.dumps(results, indent=2))
            continue
        row["folder"] = str(folder)
        for peer in peers:
            print(f"transformer: {kind}: {peer}", file=sys.stderr, flush=True)
            args = [
                "--scenario",
                "transformer",
                "--run-transformer",
                peer,
                "--folder",
                str(folder),
                "--model",
                kind,
                "--runs",
                str(runs),
                "--warmup",
                str(warmup),
                "--device",
                device,
                "--image",
                str(work / f"image-{folder.name}-{peer}.npy"),
                *(["--blocks", str(blocks)] if blocks is not None else []),
                *(["--text-layers", str(text_layers)] if text_layers is not None else []),
                *(["--cache", cache] if peer == CACHED_TRANSFORMER_PEER else []),
            ]
            limit = compile_timeout if peer == "compile" else timeout
            result = run(args, optimum_pythonpath if peer in OPTIMUM_TRANSFORMER_PEERS else None, limit)
            if peer == "compile" and str(result.get("error", "")).startswith("timed out"):
                result = {"peer": peer, "skipped": f"did not compile within {limit} s"}
            row["peers"][peer] = result
            (out / "transformer.json").write_text(json.dumps(results, indent=2))
        compare_with_ours(row)
        compare_cached(row["peers"], UNCACHED_TRANSFORMER_PEER, CACHED_TRANSFORMER_PEER)
        (out / "transformer.json").write_text(json.dumps(results, indent=2))
    write_transformer_report(results, out)
    return results


def compare_with_ours(row: Dict[str, Any]) -> None:
    """Each peer's largest pixel difference from ours (``max_abs_diff_vs_ours``), where both made an image from the
    export's own weights (the torch peers on the GPU draw theirs on the device: not comparable)."""
    ours = row["peers"].get("ours", {})
    if not ours.get("image") or "error" in ours or "skipped" in ours:
        return
    for peer, result in row["peers"].items():
        if peer != "ours" and result.get("image") and result.get("weights") == "the export's":
            result["max_abs_diff_vs_ours"] = float(np.abs(np.load(result["image"]) - np.load(ours["image"])).max())


# the video scenario's tables: text to video (the pipelines end to end), and the MLPerf shape (the transformer alone)
VIDEO_TABLES = ("video", "mlperf")
# the video scenario's peers that read the table's export (the others build diffusers' models themselves)
VIDEO_EXPORT_PEERS = ("ours", "floor")


def video_config(args: argparse.Namespace, steps: int) -> Dict[str, Any]:
    """What every process of a video run reads (``--video-config``): the models, their depths, the device, the step
    count, the runs, torch.compile's mode, the floor's replays."""
    model = "tiny-wan" if args.tiny else "wan2.1-t2v-1.3b"
    mlperf_model = "tiny-wan" if args.tiny else "wan2.2-t2v-a14b"
    return {
        "model": model,
        "blocks": args.blocks,
        "text_layers": None if args.tiny else (args.text_layers or VIDEO_TEXT_LAYERS),
        "mlperf_model": mlperf_model,
        "mlperf_blocks": args.mlperf_blocks,
        "device": args.device,
        "steps": steps,
        "runs": args.runs,
        "warmup": args.warmup,
        "compile_mode": args.compile_mode,
        "replays": VIDEO_RECIPES[model]["replays"],
        "vae_dtype": args.vae_dtype,
    }


def split_cpus(jobs: int) -> Tuple[Optional[List[int]], List[Optional[List[int]]]]:
    """The CPUs of this process split between the peers (the first half) and ``jobs`` exports (the second half, in
    equal parts), so that exports made beside the measured peers do not take their CPUs; no pinning (``None``) with
    fewer than 4 CPUs or where the system cannot pin."""
    if not hasattr(os, "sched_getaffinity"):
        return None, [None] * jobs
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 4 or jobs < 1:
        return None, [None] * jobs
    half = len(available) // 2
    rest = available[half:]
    share = max(len(rest) // jobs, 1)
    parts = [rest[i * share : (i + 1) * share] or rest for i in range(jobs)]
    return available[:half], parts


def video_benchmark(
    config: Dict[str, Any],
    peers: Sequence[str],
    mlperf_peers: Sequence[str],
    dtype: str,
    export: str,
    work: Path,
    out: Path,
    timeout: int,
    compile_timeout: int,
    run: Any = run_in_subprocess,
    exports_ahead: Optional[bool] = None,
) -> Dict[str, Any]:
    """``--scenario video``: the export of each table (:data:`VIDEO_TABLES`: the text-to-video pipeline's UMT5,
    transformer and VAE decoder; the MLPerf shape's transformer) each in a process of its own, then every peer in a
    process of its own (``run``, :func:`run_in_subprocess`). With ``exports_ahead`` (default: on CUDA) the exports run
    in the background on their share of the CPUs (:func:`split_cpus`) while the peers that need none (diffusers')
    measure on the GPU; the peers that read an export wait for it. A peer that fails has its error in its row and the
    others go on; a table whose export failed records it, and its peers that read the export record why they did not
    run; a ``compile`` peer past ``compile_timeout`` seconds is skipped as "did not compile". video.json is rewritten
    after every peer, video.md/png at the end."""
    out.mkdir(parents=True, exist_ok=True)
    cuda = config["device"] == "cuda"
    ahead = cuda if exports_ahead is None else exports_ahead
    recipe, mlperf_recipe = VIDEO_RECIPES[config["model"]], MLPERF_VIDEO_RECIPES[config["mlperf_model"]]
    results: Dict[str, Any] = {
        "environment": environment(),
        "scenario": "video",
        "dtype": dtype,
        "export": export,
        "exports_ahead": ahead,
        **config,
        "rows": [],
    }
    rows = {
        "video": {
            "table": "video",
            "model": config["model"],
            "dtype": dtype,
            "export": export,
            **{key: recipe[key] for key in ("height", "width", "num_frames", "guidance", "recipe_steps")},
            "max_sequence_length": recipe["max_sequence_length"],
            "blocks": wan_blocks(config["model"], config["blocks"]),
            "full_blocks": wan_full_blocks(config["model"]),
            "text_layers": config["text_layers"],
            "peers": {},
        }
    }
    if mlperf_peers:
        rows["mlperf"] = {
            "table": "mlperf",
            "model": config["mlperf_model"],
            "dtype": dtype,
            "export": export,
            **{key: mlperf_recipe[key] for key in ("height", "width", "num_frames", "max_sequence_length", "rows")},
            "blocks": wan_blocks(config["mlperf_model"], config["mlperf_blocks"]),
            "full_blocks": wan_full_blocks(config["mlperf_model"]),
            "peers": {},
        }
    results["rows"] = list(rows.values())
    wanted = {"video": list(peers), "mlperf": list(mlperf_peers)}
    exporting = [table for table in rows if any(peer in VIDEO_EXPORT_PEERS for peer in wanted[table])]
    peer_cpus, export_cpus = split_cpus(len(exporting)) if ahead else (None, [None] * len(exporting))

    def save() -> None:
        (out / "video.json").write_text(json.dumps(results, indent=2))

    def export_job(table: str, cpus: Optional[List[int]]) -> Callable[[], Dict[str, Any]]:
        args = [
            "--scenario",
            "video",
            "--run-video-export",
            table,
            "--video-config",
            json.dumps(config),
            "--dtypes",
            dtype,
            "--exports",
            export,
            "--work",
            str(work),
        ]
        # CPU work: the GPU hidden from it, so that nothing of it shows in the device memory the peers measure
        return lambda: run(args, None, timeout, cpus=cpus, environ={"CUDA_VISIBLE_DEVICES": ""})

    with ThreadPoolExecutor(max_workers=max(len(exporting), 1)) as pool:
        folders: Dict[str, Callable[[], Dict[str, Any]]] = {}
        for table, cpus in zip(exporting, export_cpus):
            print(f"video: {table}: export" + (" (in the background)" if ahead else ""), file=sys.stderr, flush=True)
            if ahead:
                folders[table] = pool.submit(export_job(table, cpus)).result
            else:
                done = export_job(table, cpus)()
                folders[table] = lambda done=done: done
        # the peers that need no export first, every table's: they measure while the exports are made
        order = sorted(
            ((table, peer) for table in rows for peer in wanted[table]), key=lambda job: job[1] in VIDEO_EXPORT_PEERS
        )
        measured: Dict[str, Dict[str, Dict[str, Any]]] = {table: {} for table in rows}
        for table, peer in order:
            row = rows[table]
            folder = None
            if peer in VIDEO_EXPORT_PEERS:
                made = folders[table]()
                if "folder" not in made:
                    row["export_error"] = made.get("error", "no folder in the export's result")
                    measured[table][peer] = {"peer": peer, "skipped": "the export failed"}
                    row["peers"] = {name: measured[table][name] for name in wanted[table] if name in measured[table]}
                    save()
                    continue
                folder = row["folder"] = made["folder"]
            print(f"video: {table}: {peer}", file=sys.stderr, flush=True)
            args = [
                "--scenario",
                "video",
                "--run-video",
                peer,
                "--video-table",
                table,
                "--video-config",
                json.dumps(config),
                "--image",
                str(work / f"video-{config['model']}-{dtype}-{export}-{peer}.npy"),
                *(["--folder", str(folder)] if folder is not None else []),
            ]
            limit = compile_timeout if peer == "compile" else timeout
            result = run(args, None, limit, cpus=peer_cpus)
            if peer == "compile" and str(result.get("error", "")).startswith("timed out"):
                result = {"peer": peer, "skipped": f"did not compile within {limit} s"}
            measured[table][peer] = result
            # the table keeps the order the peers were given in
            row["peers"] = {name: measured[table][name] for name in wanted[table] if name in measured[table]}
            save()
    compare_frames_with_ours(rows["video"])
    save()
    write_video_report(results, out)
    return results


def compare_frames_with_ours(row: Dict[str, Any]) -> None:
    """Each peer's largest pixel difference from ours over the whole video (``max_abs_diff_vs_ours``), where both
    saved their frames (on the CPU, where the torch peer runs the export's own weights)."""
    ours = row["peers"].get("ours", {})
    if not ours.get("video") or "error" in ours or "skipped" in ours:
        return
    for peer, result in row["peers"].items():
        if peer != "ours" and result.get("video") and result.get("weights") == "the export's":
            result["max_abs_diff_vs_ours"] = float(np.abs(np.load(result["video"]) - np.load(ours["video"])).max())


def run_video_export(table: str, config: Dict[str, Any], dtype: str, export: str, work: Path) -> Dict[str, Any]:
    """One table's export in this process (:func:`.zoo.ensure_video_export`, :func:`.zoo.ensure_mlperf_export`): its
    folder, and the seconds it took (nothing where it was made before)."""
    import time

    start = time.perf_counter()
    if table == "video":
        folder = ensure_video_export(
            config["model"],
            dtype,
            export,
            work,
            config["blocks"],
            config["text_layers"],
            device=config["device"],
            vae_dtype=config.get("vae_dtype"),
        )
    else:
        folder = ensure_mlperf_export(
            config["mlperf_model"], dtype, export, work, config["mlperf_blocks"], device=config["device"]
        )
    return {"folder": str(folder), "seconds": time.perf_counter() - start}


# the peers that are this project's pipelines, per scenario: where one of them fails, the run fails (the others'
# failures are rows of the report)
OWN_PEERS = {
    "single": OUR_PEERS,
    "mixed": OUR_PEERS,
    "stream": ("ours",),
    "transformer": OUR_TRANSFORMER_PEERS,
    "video": OUR_VIDEO_PEERS,
}


def own_failure(results: Dict[str, Any], scenario: str) -> Optional[str]:
    """Why one of our own pipelines (:data:`OWN_PEERS`) made no measurement in ``results``, in one line (the first
    such row's: which model or configuration, which peer, the last line of its error); ``None`` where each of ours
    that ran was measured. A transformer model whose export failed fails ours too."""
    own = OWN_PEERS[scenario]
    for row in results["rows"]:
        where = (
            stream_row_label(row)
            if scenario == "stream"
            else " ".join(str(row[key]) for key in ("model", "dtype", "export") if key in row)
        )
        if row.get("export_error"):
            return f"{where}: the export failed: {last_line(row['export_error'])}"
        for peer in own:
            result = row["peers"].get(peer, {})
            if "error" in result:
                return f"{peer} failed on {where}: {last_line(result['error'])}"
            if "skipped" in result:
                return f"{peer} did not run on {where}: {last_line(result['skipped'])}"
    return None


def last_line(text: Any) -> str:
    """The last non-empty line of ``text``: a traceback's exception and message."""
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no reason given"


def fail(reason: str) -> None:
    """The command's one error line, ``optimum-iobinding: error: …``, as every command writes it."""
    print(f"{PROGRAM}: error: {reason}", file=sys.stderr)


def fail_on_own_failure(results: Dict[str, Any], scenario: str, report: Path) -> bool:
    """Prints :func:`own_failure`'s reason as the command's one error line (naming ``report``, where every row
    is), and returns whether there was one."""
    reason = own_failure(results, scenario)
    if reason is not None:
        fail(f"{reason} (see {report})")
    return reason is not None


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, split: Any) -> None:
    """Every option checked before any export or peer starts: ``parser.error`` names the option, what it expects
    and what came."""

    def expect(ok: bool, option: str, expected: str, got: Any, hint: str = "") -> None:
        if not ok:
            parser.error(f"{option}: expected {expected}, got {got!r}" + (f"; {hint}" if hint else ""))

    for option, folder in (("--work", args.work), ("--out", args.out)):
        expect(not Path(folder).exists() or Path(folder).is_dir(), option, "a folder", folder, "a file has that name")
    transformer = args.scenario == "transformer"
    video = args.scenario == "video"
    choices = {
        "--models": (args.models, tuple(TRANSFORMER_RECIPES) if transformer else tuple(MODEL_SIZES)),
        # bfloat16 exports are the diffusion transformers' (the exporter refuses a UNet's)
        "--dtypes": (args.dtypes, ("fp16", "fp32", "bf16") if transformer or video else ("fp16", "fp32")),
        "--exports": (args.exports, ("plain", "optimized")),
        "--peers": (args.peers, tuple(dict.fromkeys((*PEERS, *MIXED_PEERS)))),
    }
    if args.scenario == "stream":
        del choices["--peers"]  # its own peers, checked below
    if args.scenario == "coldstart":  # each model's peers are fixed: its baseline and ours
        del choices["--peers"]
        choices["--models"] = (args.models, tuple(COLDSTART_MODELS))
        if args.models == parser.get_default("models"):
            del choices["--models"]
    if transformer or video:
        choices["--peers"] = (args.peers, TRANSFORMER_PEERS if transformer else VIDEO_PEERS)
        for option in ("--models", "--peers"):  # the other scenarios' defaults mean: the scenario's own
            if choices[option][0] == parser.get_default(option[2:]):
                del choices[option]
    if video:
        expect(
            "--models" not in choices,
            "--models",
            "none with --scenario video (it measures Wan 2.1 T2V 1.3B's architecture; --tiny the tiny Wan model)",
            args.models,
        )
        choices.pop("--models", None)
    for option, (text, known) in choices.items():
        items = split(text)
        unknown = [item for item in items if item not in known]
        hint = (
            " (bf16 only with --scenario transformer or video: the diffusion transformers)"
            if option == "--dtypes" and "bf16" in unknown
            else ""
        )
        expect(bool(items) and not unknown, option, f"a comma-separated list of {', '.join(known)}{hint}", text)
    for option, value, least in (
        ("--steps", args.steps, 1),
        ("--runs", args.runs, 1),
        ("--warmup", args.warmup, 0),
        ("--repeats", args.repeats, 1),
        ("--timeout", args.timeout, 1),
        ("--mixed-steps", args.mixed_steps, 1),
        ("--rounds", args.rounds, 1),
        ("--cycles", args.cycles, 1),
        ("--frames", args.frames, 1),
        ("--video-frames", args.video_frames, 1),
        ("--frame-warmup", args.frame_warmup, 0),
    ):
        expect(value >= least, option, f"an integer ≥ {least}", value)
    for option, value in (("--blocks", args.blocks), ("--text-layers", args.text_layers)):
        if value is not None:
            expect(
                transformer or video, option, "only with --scenario transformer or video", f"--scenario {args.scenario}"
            )
            expect(value >= 1, option, "an integer ≥ 1", value)
    expect(args.compile_timeout >= 1, "--compile-timeout", "an integer ≥ 1", args.compile_timeout)
    if video:
        check_video_arguments(parser, args, split, expect)
    else:
        for option, given in (
            ("--tiny", args.tiny),
            ("--mlperf-blocks", args.mlperf_blocks != parser.get_default("mlperf_blocks")),
            ("--mlperf-peers", args.mlperf_peers is not None),
            ("--vae-dtype", args.vae_dtype is not None),
        ):
            expect(not given, option, "only with --scenario video", f"--scenario {args.scenario}")
    if args.device == "cpu":
        expect(
            transformer or video,
            "--device",
            f"cuda with --scenario {args.scenario} (it measures CUDA pipelines; "
            "--scenario transformer --models tiny-sd3,tiny-flux --device cpu checks a setup without a GPU)",
            args.device,
        )
        dtypes = split(args.dtypes) if args.dtypes != parser.get_default("dtypes") else ["fp32"]
        expect(
            dtypes[:1] == ["fp32"],
            "--dtypes",
            "fp32 with --device cpu (a float16 or bfloat16 export is for the GPU)",
            args.dtypes,
        )
    if args.stream_features is not None:
        expect(
            args.scenario == "stream", "--stream-features", "only with --scenario stream", f"--scenario {args.scenario}"
        )
        if args.stream_features != "none":
            unknown = [item for item in split(args.stream_features) if item not in STREAM_FEATURES]
            expect(
                bool(split(args.stream_features)) and not unknown,
                "--stream-features",
                f"a comma-separated list of {', '.join(STREAM_FEATURES)}, or none",
                args.stream_features,
            )
    if args.scenario == "stream" and args.peers != parser.get_default("peers"):
        unknown = [item for item in split(args.peers) if item not in STREAM_PEERS]
        expect(
            bool(split(args.peers)) and not unknown,
            "--peers",
            f"for --scenario stream a comma-separated list of {', '.join(STREAM_PEERS)}",
            args.peers,
        )
    batches = split(args.mixed_batches)
    expect(
        bool(batches) and all(item.isdigit() and int(item) >= 1 for item in batches),
        "--mixed-batches",
        "a comma-separated list of positive integers",
        args.mixed_batches,
    )
    if args.cache is not None:
        check_cache(parser, args, split, expect)


def check_video_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, split: Any, expect: Any) -> None:
    """The video scenario's own options: ``--steps`` (at least 2: a step is timed between two step ends),
    ``--mlperf-blocks``, ``--mlperf-peers``; on the CPU only the peers that run there."""
    if args.steps != parser.get_default("steps"):
        expect(
            args.steps >= 2,
            "--steps",
            "an integer ≥ 2 with --scenario video (a step is timed between two step ends)",
            args.steps,
        )
    expect(args.mlperf_blocks >= 1, "--mlperf-blocks", "an integer ≥ 1", args.mlperf_blocks)
    if args.mlperf_peers is not None and args.mlperf_peers != "none":
        unknown = [item for item in split(args.mlperf_peers) if item not in MLPERF_PEERS]
        expect(
            bool(split(args.mlperf_peers)) and not unknown,
            "--mlperf-peers",
            f"a comma-separated list of {', '.join(MLPERF_PEERS)}, or none",
            args.mlperf_peers,
        )
    if args.device == "cpu":
        for option, text in (("--peers", args.peers), ("--mlperf-peers", args.mlperf_peers)):
            if text is None or text == "none" or text == parser.get_default(option[2:]):
                continue
            cuda_only = [item for item in split(text) if item not in CPU_VIDEO_PEERS]
            expect(
                not cuda_only,
                option,
                f"peers that run on the CPU ({', '.join(CPU_VIDEO_PEERS)}) with --device cpu",
                text,
                f"{', '.join(cuda_only)} measure{'s' if len(cuda_only) == 1 else ''} CUDA work",
            )


def video_peers_of(
    parser: argparse.ArgumentParser, args: argparse.Namespace, split: Any
) -> Tuple[List[str], List[str]]:
    """The video scenario's peers and the MLPerf table's: as given, else every peer that runs on the device."""
    cpu = args.device == "cpu"
    if args.peers != parser.get_default("peers"):
        peers = split(args.peers)
    else:
        peers = list(CPU_VIDEO_PEERS if cpu else VIDEO_PEERS)
    if args.mlperf_peers == "none":
        mlperf: List[str] = []
    elif args.mlperf_peers is not None:
        mlperf = split(args.mlperf_peers)
    else:
        mlperf = list(CPU_VIDEO_PEERS) if cpu else ["ours", "compile"]
    return peers, mlperf


def video_main(parser: argparse.ArgumentParser, args: argparse.Namespace, split: Any, out: Path) -> int:
    """``--scenario video`` from the command line: its exports alone (``--export-only``), or the benchmark (the
    exports for ``--device``: float32 with the CPU's fusions on the CPU, fused float16 on CUDA by default). Exit status
    1 where ours failed (:func:`own_failure`) or every peer did."""
    import torch

    steps = args.steps if args.steps != parser.get_default("steps") else None
    config = video_config(args, steps or VIDEO_RECIPES["tiny-wan" if args.tiny else "wan2.1-t2v-1.3b"]["steps"])
    dtype, export = stream_export(parser, args, split, default_dtype="fp32" if args.device == "cpu" else "fp16")
    peers, mlperf_peers = video_peers_of(parser, args, split)
    if args.export_only:
        for table in VIDEO_TABLES if mlperf_peers else VIDEO_TABLES[:1]:
            print(run_video_export(table, config, dtype, export, Path(args.work))["folder"], flush=True)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: no CUDA GPU is visible to torch here (--tiny runs the tiny Wan model on the host)")
        return 2
    results = video_benchmark(
        config,
        peers,
        mlperf_peers,
        dtype,
        export,
        Path(args.work),
        out,
        args.timeout,
        args.compile_timeout,
        run=run_in_subprocess,
    )
    print((out / "video.md").read_text())
    if fail_on_own_failure(results, "video", out / "video.md"):
        return 1
    measured = [
        result
        for row in results["rows"]
        for result in row["peers"].values()
        if "error" not in result and "skipped" not in result
    ]
    if not measured:
        fail("every video peer failed or was skipped; see video.md for why")
        return 1
    return 0


def check_cache(parser: argparse.ArgumentParser, args: argparse.Namespace, split: Any, expect: Any) -> None:
    """``--cache``: a scenario that takes it (:data:`CACHE_SCENARIOS`), a spec of the form
    :func:`~optimum_iobinding.cache_spec.parse_cache_spec` reads, of the cache the scenario's models take (DeepCache
    for the UNets, First-Block Cache for the transformers), the uncached twin among ``--peers``, and transformers
    deep enough to skip a block."""
    expect(
        args.scenario in CACHE_SCENARIOS,
        "--cache",
        f"only with --scenario {' or '.join(CACHE_SCENARIOS)}",
        f"--scenario {args.scenario}",
    )
    try:
        kind, _ = parse_cache_spec(args.cache, "--cache")
    except ArgumentError as error:
        parser.error(str(error))
    transformer = args.scenario == "transformer"
    takes, form, family, elsewhere = CACHE_SCENARIOS[args.scenario]
    models = (
        split(args.models)
        if args.models != parser.get_default("models")
        else (list(TRANSFORMER_DEFAULT_MODELS) if transformer else split(args.models))
    )
    expect(kind == takes, "--cache", f"{form} for {family} of --models ({', '.join(models)})", args.cache, elsewhere)
    uncached = UNCACHED_TRANSFORMER_PEER if transformer else UNCACHED_PEER
    if args.peers != parser.get_default("peers"):
        expect(
            uncached in split(args.peers),
            "--peers",
            f"{uncached} among them with --cache",
            args.peers,
            f"the {CACHED_PEER} row's speed-up is over {uncached}, on the same files",
        )
    for model in models if transformer else ():
        depth = sum(transformer_blocks(model, args.blocks) or TRANSFORMER_BLOCKS[model])
        expect(
            depth >= 2,
            "--cache",
            "transformers of at least 2 blocks (First-Block Cache runs the first and skips the others)",
            f"{model} with --blocks {args.blocks}: {depth} block",
            "raise --blocks",
        )


def stream_features_of(args: argparse.Namespace, split: Any) -> List[str]:
    """The stream scenario's feature rows: ``--stream-features`` as given, none for ``none``, else all of
    :data:`STREAM_FEATURES`."""
    if args.stream_features is None:
        return list(STREAM_FEATURES)
    return [] if args.stream_features == "none" else split(args.stream_features)


def stream_export(
    parser: argparse.ArgumentParser, args: argparse.Namespace, split: Any, default_dtype: str = "fp16"
) -> Tuple[str, str]:
    """The stream and transformer scenarios' one export: the first of --dtypes and of --exports where given, else
    fused ``default_dtype``."""
    dtype = split(args.dtypes)[0] if args.dtypes != parser.get_default("dtypes") else default_dtype
    export = split(args.exports)[0] if args.exports != parser.get_default("exports") else "optimized"
    return dtype, export


def transformer_main(parser: argparse.ArgumentParser, args: argparse.Namespace, split: Any, out: Path) -> int:
    """``--scenario transformer`` from the command line: its exports alone (``--export-only``), or the benchmark.
    The export is made for ``--device``: on the CPU float32 with the CPU's fusions (fused float16 is the GPU's
    default). Exit status 1 where ours failed (:func:`own_failure`) or every peer did."""
    import torch

    models = split(args.models) if args.models != parser.get_default("models") else list(TRANSFORMER_DEFAULT_MODELS)
    peers = split(args.peers) if args.peers != parser.get_default("peers") else list(TRANSFORMER_PEERS)
    dtype, export = stream_export(parser, args, split, default_dtype="fp32" if args.device == "cpu" else "fp16")
    if args.export_only:
        for kind in models:
            print(
                ensure_transformer_export(
                    kind, dtype, export, Path(args.work), args.blocks, args.text_layers, device=args.device
                ),
                flush=True,
            )
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: no CUDA GPU is visible to torch here (--device cpu runs the tiny models on the host)")
        return 2
    results = transformer_benchmark(
        models,
        peers,
        dtype,
        export,
        args.blocks,
        args.text_layers,
        args.runs,
        args.warmup,
        args.device,
        Path(args.work),
        out,
        args.optimum_pythonpath,
        args.timeout,
        args.compile_timeout,
        cache=args.cache,
    )
    print((out / "transformer.md").read_text())
    if fail_on_own_failure(results, "transformer", out / "transformer.md"):
        return 1
    measured = [result for row in results["rows"] for result in row["peers"].values() if "end_to_end_ms" in result]
    if not measured:
        fail("every transformer peer failed or was skipped; see transformer.md for why")
        return 1
    return 0


def build_parser() -> CommandLineParser:
    """The options of ``optimum-iobinding bench`` (and the hidden ones of a peer's process)."""
    parser = CommandLineParser(prog="optimum-iobinding bench", description=DESCRIPTION, allow_abbrev=False)
    # taken by optimum-iobinding before the command runs (here for --help): set or not, the same options pass
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    parser.add_argument(
        "--models",
        default="tiny,small,sd15",
        help=f"comma-separated architectures, random weights: the UNets {', '.join(MODEL_SIZES)} (default "
        f"tiny,small,sd15); with --scenario transformer {', '.join(TRANSFORMER_RECIPES)} (default "
        f"{','.join(TRANSFORMER_DEFAULT_MODELS)})",
    )
    parser.add_argument(
        "--dtypes",
        default="fp16,fp32",
        help="comma-separated export precisions, fp16 and fp32 (default fp16,fp32); bf16 with --scenario transformer "
        "or video; the stream, transformer and video scenarios take the first (default there: fp16)",
    )
    parser.add_argument(
        "--exports",
        default="plain,optimized",
        help="comma-separated: plain (the exporter's graph) and optimized (ORT's fusions) (default plain,optimized); "
        "the stream and transformer scenarios take the first (default there: optimized)",
    )
    parser.add_argument(
        "--peers",
        default=",".join(PEERS),
        help="comma-separated pipelines to measure, each in a process of its own (default: every peer of the "
        f"scenario): single {', '.join(PEERS)}; mixed {', '.join(MIXED_PEERS)}; stream {', '.join(STREAM_PEERS)}; "
        f"transformer {', '.join(TRANSFORMER_PEERS)}; video {', '.join(VIDEO_PEERS)}",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=30,
        help="single: denoising steps of a timed call (LCM and turbo keep their recipe's; the transformers theirs); "
        "mixed: steps of the first image; video: steps of a timed call, at least 2 (default 4, of the recipe's 50)",
    )
    parser.add_argument("--runs", type=int, default=3, help="timed calls per step count; the table shows their median")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls before the timed ones")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="single: processes per peer, the peer order rotated each time; the table shows the median over them. "
        "coldstart: the whole measure that many times (the baseline and ours in swapped order every other time, a "
        "cache folder each), and each peer's median",
    )
    parser.add_argument("--work", default="bench-work", help="where exports and images go")
    parser.add_argument("--out", default="benchmarks/results/latest", help="where the results and reports go")
    parser.add_argument(
        "--optimum-pythonpath",
        default=None,
        help="site folder of the optimum-onnx environment (default: none: optimum's peers run with this "
        "environment's packages)",
    )
    parser.add_argument("--timeout", type=int, default=900, help="seconds per peer process")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="re-render the reports (.md, and .png with matplotlib) from the results files in --out",
    )
    parser.add_argument(
        "--scenario",
        choices=("single", "mixed", "stream", "transformer", "video", "coldstart"),
        default="single",
        help="single: one batch size, every peer; mixed: batch sizes in turn, rounds; coldstart: load and first "
        "image in fresh processes, SD 1.5 against diffusers' numpy pipeline and FLUX.1 schnell (2 + 4 blocks) against "
        "optimum (--models sd15,flux-schnell); "
        "stream: frames through few-step image to image (turbo, 512², batch 1); transformer: "
        "SD3.5 Medium and FLUX.1 (--models sd35m,flux-schnell,flux-dev; tiny-sd3,tiny-flux), "
        "1024², batch 1; video: Wan 2.1 T2V 1.3B, 480×832, 81 frames, and the MLPerf shape (Wan 2.2 A14B's "
        "transformer, 720×1280)",
    )
    parser.add_argument("--mixed-batches", default="1,4,8,2", help="mixed: images per call, in turn")
    parser.add_argument("--mixed-steps", type=int, default=10, help="mixed: steps per call")
    parser.add_argument("--rounds", type=int, default=3, help="mixed: rounds over the batch sizes")
    parser.add_argument(
        "--cycles",
        type=int,
        default=3,
        help="mixed: passes over the batch sizes per round; a round's time per batch size is the median of its calls",
    )
    parser.add_argument("--frames", type=int, default=200, help="stream: timed frames per peer")
    parser.add_argument("--video-frames", type=int, default=120, help="stream: frames of the 512² video")
    parser.add_argument("--frame-warmup", type=int, default=10, help="stream: untimed frames first")
    parser.add_argument(
        "--stream-features",
        default=None,
        metavar="NAMES",
        help="stream: the feature rows after the plain ones, comma-separated among "
        f"{', '.join(STREAM_FEATURES)} (default: all of them), or none: guidance 1.5 (classifier-free, "
        "residual self and initialize), the similarity filter 0.98 on a still and a moving clip, one ControlNet with "
        "a fixed control image or one per frame, one IP-Adapter with a fixed image prompt or a new one per frame; "
        "each at 1 step with the tiny VAE, measured by ours and the floor",
    )
    parser.add_argument(
        "--blocks",
        type=int,
        default=None,
        help="transformer: build the transformers with N blocks (FLUX.1: N double, 2N single), full "
        "width; video: Wan 2.1's transformer with N of its 30 blocks; every result row says so (default: the "
        "full model's blocks)",
    )
    parser.add_argument(
        "--text-layers",
        type=int,
        default=None,
        help="transformer: at most N layers in each text encoder (CLIP-L, CLIP-G, T5); video: UMT5's layers "
        f"(default {VIDEO_TEXT_LAYERS} of 24, full width)",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="transformer and video: where the peers run, and what the export is made for (cpu: the tiny "
        "models on an fp32 export with the CPU's fusions, to check a setup); default cuda, with --tiny cpu",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="video: the tiny random Wan model at a tiny size, every code path of the scenario (on the CPU "
        "unless --device cuda: ours and diffusers' eager pipeline)",
    )
    parser.add_argument(
        "--vae-dtype",
        choices=("fp32", "fp16"),
        default=None,
        help="video: our export's VAE precision (export --vae-dtype; default fp32, as diffusers runs it)",
    )
    parser.add_argument(
        "--mlperf-blocks",
        type=int,
        default=2,
        help="video: the MLPerf table's transformer (Wan 2.2 T2V A14B's) with N of its 40 blocks (default 2)",
    )
    parser.add_argument(
        "--mlperf-peers",
        default=None,
        help=f"video: the MLPerf table's peers, comma-separated among {', '.join(MLPERF_PEERS)}, or none "
        "(default: ours,compile; on the CPU ours,torch)",
    )
    parser.add_argument(
        "--compile-mode",
        choices=COMPILE_MODES,
        default="default",
        help="video: torch.compile's mode for the compile peers (default: default)",
    )
    parser.add_argument(
        "--compile-timeout",
        type=int,
        default=900,
        help="transformer: seconds for the compile peer's process; past it: skipped, did not compile",
    )
    parser.add_argument(
        "--export-only",
        action="store_true",
        help="only make the exports under --work (e.g. in the background, ahead of the benches)",
    )
    parser.add_argument(
        "--cache",
        default=None,
        metavar="SPEC",
        help="single and transformer: one more row, 'cached': our default pipeline with this step "
        "cache (deepcache:INTERVAL[:BRANCH] for the UNets, fbc:THRESHOLD for the transformers) "
        "on the same files as the uncached row, with the steps it skipped and its speed-up",
    )
    # one peer in this process (used by the orchestrator)
    parser.add_argument("--run-peer", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-floor", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-mixed", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-stream", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-transformer", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-video", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-video-export", default=None, choices=VIDEO_TABLES, help=argparse.SUPPRESS)
    parser.add_argument("--video-table", default="video", choices=VIDEO_TABLES, help=argparse.SUPPRESS)
    parser.add_argument("--video-config", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--stream-config", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tiny-vae-folder", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--image", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parser


def rerender_reports(parser: argparse.ArgumentParser, out: Path) -> int:
    """``--report-only``: each results file in ``out`` rendered again into its report (and its chart where
    matplotlib is installed), each file written named; a folder holding none is refused naming ``--out``."""
    from .report import _pyplot

    writers = {
        "results.json": write_report,
        "mixed.json": write_mixed_report,
        "stream.json": write_stream_report,
        "transformer.json": write_transformer_report,
        "video.json": write_video_report,
        "coldstart.json": write_coldstart_report,
    }
    found = [name for name in writers if (out / name).is_file()]
    if not found:
        parser.error(
            f"--out: expected a folder holding an earlier run's results ({', '.join(writers)}), got {str(out)!r}"
            f"{', which holds none' if out.is_dir() else ', which is no folder'}"
        )
    charts = _pyplot() is not None
    for name in found:
        stem = name[: -len(".json")]
        try:
            results = json.loads((out / name).read_text())
        except ValueError as error:
            parser.error(
                f"--out: expected {name} of an earlier run in {str(out)!r}, got one that does not parse ({error})"
            )
        writers[name](results, out)
        made = [f"{stem}.md"] + ([f"{stem}.png"] if charts and (out / f"{stem}.png").is_file() else [])
        print(f"{out / name} → {', '.join(made)}", flush=True)
    if not charts:
        print("no charts: matplotlib is not installed (pip install 'optimum-iobinding[plot]')", flush=True)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse's refusal, with the option a misspelled one is close to
        parser.error(
            unrecognized_arguments(unknown, (option for action in parser._actions for option in action.option_strings))
        )
    split = lambda text: [item for item in text.split(",") if item]  # noqa: E731
    if args.device is None:  # the tiny video model runs on the host unless told otherwise
        args.device = "cpu" if args.tiny else "cuda"
    check_arguments(parser, args, split)
    if not args.report_only:  # re-rendering reports loads no library
        quiet_libraries()
    if args.run_mixed:
        result = run_mixed(
            args.run_mixed,
            Path(args.folder),
            args.model,
            args.dtype,
            [int(b) for b in split(args.mixed_batches)],
            args.mixed_steps,
            args.rounds,
            args.steps,
            args.cycles,
        )
        Path(args.result).write_text(json.dumps(result))
        return 0
    if args.run_stream:
        tiny_vae = Path(args.tiny_vae_folder) if args.tiny_vae_folder else None
        try:
            result = run_stream_peer(
                args.run_stream,
                Path(args.folder),
                tiny_vae,
                json.loads(args.stream_config),
                args.frames,
                args.frame_warmup,
                Path(args.work),
            )
        except PeerUnavailable as reason:
            result = {"peer": args.run_stream, "skipped": str(reason)}
        Path(args.result).write_text(json.dumps(result))
        return 0
    if args.run_transformer:
        peer = args.run_transformer
        try:
            if peer == "floor":
                result = run_transformer_floor(Path(args.folder), args.model, args.device)
            else:
                result = run_transformer_peer(
                    peer,
                    Path(args.folder),
                    args.model,
                    args.blocks,
                    args.text_layers,
                    args.runs,
                    args.warmup,
                    args.device,
                    Path(args.image),
                    args.cache,
                )
        except PeerUnavailable as reason:
            result = {"peer": peer, "skipped": str(reason)}
        Path(args.result).write_text(json.dumps(result))
        return 0
    if args.run_video_export:
        config = json.loads(args.video_config)
        result = run_video_export(
            args.run_video_export, config, split(args.dtypes)[0], split(args.exports)[0], Path(args.work)
        )
        Path(args.result).write_text(json.dumps(result))
        return 0
    if args.run_video:
        peer, config = args.run_video, json.loads(args.video_config)
        folder = Path(args.folder) if args.folder else None
        try:
            if args.video_table == "mlperf":
                result = run_mlperf_peer(peer, folder, config)
            elif peer == "floor":
                result = run_video_floor(folder, config)
            else:
                result = run_video_peer(peer, folder, config, Path(args.image))
        except PeerUnavailable as reason:
            result = {"peer": peer, "skipped": str(reason)}
        Path(args.result).write_text(json.dumps(result))
        return 0
    if args.run_peer or args.run_floor:
        if args.run_floor:
            result = run_floor(Path(args.folder), args.model)
        else:
            result = run_peer(
                args.run_peer,
                Path(args.folder),
                args.model,
                args.dtype,
                args.steps,
                args.runs,
                args.warmup,
                Path(args.image),
                args.cache,
            )
        Path(args.result).write_text(json.dumps(result))
        return 0
    out = Path(args.out)
    if args.report_only:
        return rerender_reports(parser, out)
    if args.scenario == "transformer":
        return transformer_main(parser, args, split, out)
    if args.scenario == "video":
        return video_main(parser, args, split, out)
    if args.export_only and args.scenario == "stream":
        dtype, export = stream_export(parser, args, split)
        print(ensure_export(STREAM_KIND, dtype, export, Path(args.work)), flush=True)
        print(ensure_tiny_vae_export(dtype, export, Path(args.work)), flush=True)
        nets = {STREAM_FEATURES[name].get("controlnets") for name in stream_features_of(args, split)} - {None}
        for count in sorted(nets):
            print(ensure_controlnet_export(STREAM_KIND, dtype, export, Path(args.work), count), flush=True)
        if any(STREAM_FEATURES[name].get("image_prompt") for name in stream_features_of(args, split)):
            print(ensure_ip_adapter_export(STREAM_KIND, dtype, export, Path(args.work)), flush=True)
        return 0
    if args.export_only and args.scenario == "coldstart":
        models = split(args.models) if args.models != parser.get_default("models") else list(COLDSTART_MODELS)
        for model in models:
            settings = COLDSTART_MODELS[model]
            if settings["scenario"] == "single":
                print(ensure_export(model, "fp16", "optimized", Path(args.work)), flush=True)
            else:
                folder = ensure_transformer_export(
                    model, "fp16", "optimized", Path(args.work), settings["blocks"], settings["text_layers"]
                )
                print(folder, flush=True)
        return 0
    if args.export_only:
        for kind in split(args.models):
            for dtype in split(args.dtypes):
                for export in split(args.exports):
                    print(
                        ensure_export(kind, dtype, export, Path(args.work), step_cache=args.cache is not None),
                        flush=True,
                    )
        return 0
    import torch  # here, after the arguments: --help and their mistakes need no torch

    if not torch.cuda.is_available():  # what this machine cannot do, known before any work: as a mistake, status 2
        fail(
            "no CUDA GPU is visible to torch here; the benchmark measures CUDA pipelines (--export-only and "
            "--report-only work without one; --scenario transformer --device cpu checks a setup on the host)"
        )
        return 2
    if args.scenario == "coldstart":
        models = split(args.models) if args.models != parser.get_default("models") else list(COLDSTART_MODELS)
        results = coldstart_benchmark(
            models,
            Path(args.work),
            out,
            args.optimum_pythonpath,
            args.timeout,
            args.compile_timeout,
            run_single=benchmark,
            run_transformer=transformer_benchmark,
            environment=environment(),
            repeats=args.repeats,
        )
        print((out / "coldstart.md").read_text())
        ours = [row for row in results["rows"] if row["peer"] not in ("numpy", "optimum")]
        if not ours or any("error" in row for row in ours):
            fail("one of our pipelines made no cold start; see coldstart.md for why")
            return 1
        return 0
    if args.scenario == "stream":
        peers = split(args.peers) if args.peers != parser.get_default("peers") else list(STREAM_PEERS)
        dtype, export = stream_export(parser, args, split)
        results = stream_benchmark(
            peers,
            dtype,
            export,
            args.frames,
            args.video_frames,
            args.frame_warmup,
            Path(args.work),
            out,
            args.timeout,
            features=stream_features_of(args, split),
        )
        print((out / "stream.md").read_text())
        if fail_on_own_failure(results, "stream", out / "stream.md"):
            return 1
        failed = all("fps" not in result for row in results["rows"] for result in row["peers"].values())
        if failed:
            fail("every stream peer failed or was skipped; see stream.md for why")
        return 1 if failed else 0
    if args.scenario == "mixed":
        peers = (
            [peer for peer in split(args.peers) if peer in MIXED_PEERS]
            if args.peers != parser.get_default("peers")
            else list(MIXED_PEERS)
        )
        results = mixed_benchmark(
            split(args.models),
            split(args.dtypes),
            split(args.exports),
            peers,
            [int(b) for b in split(args.mixed_batches)],
            args.mixed_steps,
            args.rounds,
            args.steps,
            Path(args.work),
            out,
            args.timeout,
            args.cycles,
        )
        print((out / "mixed.md").read_text())
        return 1 if fail_on_own_failure(results, "mixed", out / "mixed.md") else 0
    results = benchmark(
        split(args.models),
        split(args.dtypes),
        split(args.exports),
        split(args.peers),
        args.steps,
        args.runs,
        args.warmup,
        Path(args.work),
        out,
        args.optimum_pythonpath,
        args.timeout,
        args.repeats,
        cache=args.cache,
    )
    print((out / "results.md").read_text())
    if fail_on_own_failure(results, "single", out / "results.md"):
        return 1
    measured = [
        result
        for row in results["rows"]
        for result in row["peers"].values()
        if "error" not in result and "skipped" not in result
    ]
    if not measured:
        fail("every peer failed or was skipped; see results.md for why")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
