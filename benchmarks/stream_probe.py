"""A first measure of the real-time stream on a GPU: frames/s and per-frame latency of `OnnxStreamDiffusionPipeline`
(torch CUDA frames in and out) against the floor of its components' own graph replays, with guidance (classifier-free,
StreamDiffusion's residual), the similarity filter and ControlNets (one or two, a fixed control image or one per
frame: ``--configs``).

SD-Turbo's architecture (``--model turbo``: the bench zoo's ``turbo``) or SDXL-Turbo's (``--model sdxl-turbo``: the
zoo's ``sdxl``, SDXL base's architecture, which SDXL-Turbo shares; the stream gives it an
``OnnxStreamDiffusionXLPipeline``), random weights, fused fp16, with SD-Turbo's scheduler (Euler ancestral, trailing
timesteps); a TAESD-shaped `AutoencoderTiny` with random weights (fp16, CUDA-optimized: taesdxl has the same
architecture), ``--size`` (512²), batch 1. Writes ``stream_probe.json`` (every row, device, versions,
the command) to ``--out``. The full comparison with the other peers is ``optimum-iobinding bench --scenario stream``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from optimum_iobinding import OnnxStreamDiffusionPipeline
from optimum_iobinding.bench.probes import environment
from optimum_iobinding.bench.zoo import ensure_controlnet_export, ensure_export, set_recipe_scheduler
from optimum_iobinding.export import export_pipeline


def tiny_vae_folder(work: Path) -> Path:
    folder = work / "taesd-random-fp16-optimized"
    if not (folder / "vae_decoder" / "model.onnx").is_file():
        from diffusers import AutoencoderTiny

        torch.manual_seed(0)
        export_pipeline(None, folder, tiny_vae=AutoencoderTiny(), fp16=True, optimize="cuda", progress=False)
    return folder


def events_ms(function, runs: int) -> float:
    """Median ms of ``function()`` over ``runs`` calls, each timed with CUDA events on the current stream."""
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(stream: OnnxStreamDiffusionPipeline, clip: list, frames: int, controls: list = None) -> dict:
    """Latency (each frame waited for) and frames/s (frames enqueued back to back) over ``frames`` frames of
    ``clip`` (cycled); ``controls``: a control image given with each frame (cycled; a ControlNet stream)."""

    def feed(index: int):
        if controls:
            return stream(clip[index % len(clip)], control_image=controls[index % len(controls)])
        return stream(clip[index % len(clip)])

    for index in range(20):
        feed(index)
    torch.cuda.synchronize()
    latencies = []
    for index in range(frames):  # latency: each frame waited for
        start = time.perf_counter()
        out = feed(index)
        torch.cuda.synchronize()
        latencies.append((time.perf_counter() - start) * 1e3)
    skipped = stream.skipped_frames
    start = time.perf_counter()
    for index in range(frames):  # throughput: frames enqueued back to back, as a stream runs
        out = feed(index)
    torch.cuda.synchronize()
    fps = frames / (time.perf_counter() - start)
    skipped = stream.skipped_frames - skipped
    latencies.sort()
    return {
        "fps": fps,
        "p50_ms": latencies[len(latencies) // 2],
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1],
        "output": [list(out.shape), str(out.dtype), str(out.device)] if out is not None else None,
        "skipped_share": skipped / frames,  # of the frames/s run (the similarity filter's)
    }


def floor_ms(stream: OnnxStreamDiffusionPipeline, batch: int, size: int) -> dict:
    """Each component's own graph replays back to back (median of 50), at the stream's shapes (the UNet's: the
    prepared plan's inputs, of ``batch`` rows)."""
    device = stream.device
    latent = size // stream.vae_scale_factor
    channels = stream.unet.input_dims["sample"][1] if isinstance(stream.unet.input_dims["sample"][1], int) else 4

    def typed(name, model, shape):
        return torch.randn(shape, device=device).to(model.input_dtypes[name])

    image = typed("sample", stream.vae_encoder, (1, 3, size, size))
    z = typed("latent_sample", stream.vae_decoder, (1, channels, latent, latent))
    unet_inputs = {name: value.clone() for name, value in stream.unet_inputs.items()}
    assert unet_inputs["sample"].shape[0] == batch, (tuple(unet_inputs["sample"].shape), batch)
    calls = {"vae_encoder": lambda: stream.vae_encoder(sample=image)}
    for k, net in enumerate(getattr(stream, "controlnets", [])):  # each ControlNet, and the UNet with residuals
        inputs = {name: value.clone() for name, value in stream.control_inputs[k].items()}
        calls[f"controlnet_{k}"] = lambda net=net, inputs=inputs: net(**inputs)
        residuals = [r.clone() for r in net(**inputs)]
        unet_inputs.update(zip(stream.denoiser.residual_inputs, residuals))
    calls["unet"] = lambda: stream.unet(**unet_inputs)
    calls["vae_decoder"] = lambda: stream.vae_decoder(latent_sample=z)
    result = {}
    for name, call in calls.items():
        for _ in range(5):
            call()
        result[name] = events_ms(lambda: [call() for _ in range(10)], 20) / 10
    result["sum"] = sum(result.values())
    return result


# name → (UNet steps, stream batch, prepare's options, clip): the plain stream at 1 and 2 steps, guidance (full
# classifier-free, StreamDiffusion's residual "self" and "initialize"), the similarity filter on a still clip (what it
# skips) and on a moving one (what deciding costs a frame that is kept: frame ms against "one-step")
CONFIGS = {
    "one-step": (1, False, {}, "moving"),
    "two-steps-stream-batch": (2, True, {}, "moving"),
    "two-steps-in-turn": (2, False, {}, "moving"),
    "full-cfg": (1, False, {"guidance_scale": 1.5, "cfg_type": "full"}, "moving"),
    "rcfg-self": (1, False, {"guidance_scale": 1.5, "cfg_type": "self"}, "moving"),
    "rcfg-initialize": (1, False, {"guidance_scale": 1.5, "cfg_type": "initialize"}, "moving"),
    "filter-still": (1, False, {"similarity_threshold": 0.98}, "still"),
    "filter-moving": (1, False, {"similarity_threshold": 0.98}, "moving"),
    # with ControlNets (--model turbo): a fixed control image, and one given with every frame
    "controlnet": (1, False, {"control": "fixed"}, "moving"),
    "controlnet-per-frame": (1, False, {"control": "per-frame"}, "moving"),
    "controlnets-two": (1, False, {"control": "fixed", "controlnets": 2}, "moving"),
}
CONTROLNET_CONFIGS = ("controlnet", "controlnet-per-frame", "controlnets-two")
STEP_CONFIGS = ("one-step", "two-steps-stream-batch", "two-steps-in-turn")  # also with the full VAE


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--work", default="/tmp/bench-work")
    parser.add_argument("--out", required=True)
    parser.add_argument("--frames", type=int, default=300)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--model", default="turbo", choices=("turbo", "sdxl-turbo"))
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated, of {', '.join(CONFIGS)} (each with the tiny VAE; the step ones with the full one too)",
    )
    args = parser.parse_args()
    unknown = sorted(set(args.configs.split(",")) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: expected names among {', '.join(CONFIGS)}, got {', '.join(unknown)}")
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = ensure_export("turbo" if args.model == "turbo" else "sdxl", "fp16", "optimized", work)
    tiny = tiny_vae_folder(work)
    rows = []
    torch.manual_seed(0)
    frame = torch.rand(1, 3, args.size, args.size, device="cuda") * 2 - 1
    # a moving clip (every frame new: the similarity filter keeps each) and a still one (the same frame)
    moving = [torch.rand(1, 3, args.size, args.size, device="cuda") * 2 - 1 for _ in range(8)]
    clips = {"still": [frame], "moving": moving}
    chosen = args.configs.split(",")
    # a stream per folder and VAE: the model's (the step configurations with the full VAE too) and, for the
    # ControlNet configurations, the model's export with one or two ControlNets
    groups = {}
    for name in chosen:
        nets = CONFIGS[name][2].get("controlnets", 1) if name in CONTROLNET_CONFIGS else 0
        for vae in ("tiny", "full") if name in STEP_CONFIGS else ("tiny",):
            groups.setdefault((nets, vae), []).append(name)
    controls = [torch.rand(1, 3, args.size, args.size, device="cuda") for _ in range(8)]  # in [0, 1]
    for (nets, vae), configs in groups.items():
        if nets and args.model != "turbo":
            rows += [{"config": name, "error": "ControlNet streams: --model turbo"} for name in configs]
            continue
        stream = OnnxStreamDiffusionPipeline.from_pretrained(
            ensure_controlnet_export("turbo", "fp16", "optimized", work, nets) if nets else folder,
            provider="CUDAExecutionProvider",
            tiny_vae=tiny if vae == "tiny" else None,
        )
        set_recipe_scheduler(stream, "turbo")  # SD-Turbo's and SDXL-Turbo's: Euler ancestral, trailing timesteps
        for name in configs:
            steps, stream_batch, options, clip = CONFIGS[name]
            row = {"config": name, "vae": vae, "unet_steps": steps, "stream_batch": stream_batch, **options}
            control = options.get("control")
            prepare_options = {k: v for k, v in options.items() if k not in ("control", "controlnets")}
            if control == "fixed":
                prepare_options["control_image"] = controls[0] if nets == 1 else controls[:nets]
            try:
                start = time.perf_counter()
                stream.prepare(
                    "a photo of a cat",
                    num_inference_steps=2 * steps,
                    strength=0.5,
                    seed=0,
                    height=args.size,
                    width=args.size,
                    stream_batch=stream_batch,
                    **{"guidance_scale": 0.0, **prepare_options},
                )
                row["prepare_s"] = time.perf_counter() - start
                row.update(measure(stream, clips[clip], args.frames, controls if control == "per-frame" else None))
                rows_per_step = 2 if options.get("cfg_type") == "full" else 1
                unet_batch = (steps if stream_batch else 1) * rows_per_step
                unet_batch += 1 if options.get("cfg_type") == "initialize" else 0
                row["floor_ms"] = floor_ms(stream, unet_batch, args.size)
                unet_calls = 1 if stream_batch else steps
                per_step = sum(
                    ms for part, ms in row["floor_ms"].items() if part == "unet" or part.startswith("controlnet")
                )
                floor = row["floor_ms"]["vae_encoder"] + unet_calls * per_step + row["floor_ms"]["vae_decoder"]
                row["floor_frame_ms"] = floor
                row["frame_ms"] = 1e3 / row["fps"]
                row["ratio_to_floor"] = row["frame_ms"] / floor
            except Exception as error:  # one configuration failing must not lose the others
                row["error"] = f"{type(error).__name__}: {error}"[:2000]
            print(json.dumps(row), flush=True)
            rows.append(row)
        del stream
        torch.cuda.empty_cache()
    result = {
        "command": " ".join(["python3", *sys.argv]),
        "environment": environment(),
        "model": args.model,
        "size": args.size,
        "frames": args.frames,
        "rows": rows,
    }
    (out / "stream_probe.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
