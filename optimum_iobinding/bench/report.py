"""The benchmark's reports: peers' results combined (:func:`combine_repeats`, :func:`mixed_summary`) and rendered
— results.json → results.md and results.png, mixed.json → mixed.md and one mixed-*.png per configuration (charts
only where matplotlib is installed)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ..families import family
from .zoo import TRANSFORMER_BLOCKS


def combine_repeats(results: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One peer's results from several processes (``--repeats``) as one: the median over the processes of each
    one's median time, per-step time, load and first-image seconds; the highest memory peak and copy counts; every
    timed run in ``end_to_end_ms_all``; each process's own result in ``repeats``. A process that failed or was
    skipped makes the whole result that failure (with the others kept in ``repeats``)."""
    if len(results) == 1:
        return results[0]
    kept = [{key: value for key, value in result.items() if key != "image"} for result in results]
    for result in results:
        if "error" in result or "skipped" in result:
            return {**result, "repeats": kept}
    combined = dict(results[0])
    for key in (
        "end_to_end_ms",
        "per_step_ms",
        "load_s",
        "first_image_s",
        "own_floor_ms",
        "per_step_over_own_floor",
        "gpu_step_ms",
        "gpu_step_over_own_floor",
    ):
        values = [result[key] for result in results if result.get(key) is not None]
        combined[key] = statistics.median(values) if values else None
    for key in ("peak_memory_mib", "htod_bytes_per_step", "dtoh_bytes_per_step"):
        combined[key] = max(result[key] for result in results)
    combined["end_to_end_ms_all"] = [ms for result in results for ms in result.get("end_to_end_ms_all", [])]
    combined["repeats"] = kept
    return combined


def mixed_summary(result: Dict[str, Any]) -> Dict[str, Any]:
    """Per batch size: the best round's ms and the worst later round's ratio to it (the "within 5 %" check); and
    whether any session was created after the first round."""
    rounds = result["per_round_ms"]
    worst, best = {}, {}
    for batch in map(str, result["batches"]):
        times = [row[batch] for row in rounds]
        best[batch] = min(times)
        worst[batch] = max(times[1:]) / best[batch] if len(times) > 1 else 1.0
    sessions = [count for count in result.get("sessions_after_round", []) if count is not None]
    return {
        "best_ms": best,
        "worst_later_round_ratio": worst,
        "sessions_created_after_round_1": (sessions[-1] - sessions[0]) if sessions else None,
    }


def _bar_chart(
    plt: Any, labels: Sequence[str], values: Sequence[float], colors: Any, xlabel: str, title: str, path: Path
) -> None:
    """One horizontal bar per label, top to bottom, written to ``path``."""
    figure, axis = plt.subplots(figsize=(10, 0.35 * len(labels) + 1.5))
    axis.barh(range(len(labels)), values, color=colors)
    axis.set_yticks(range(len(labels)), labels, fontsize=7)
    axis.invert_yaxis()
    axis.set_xlabel(xlabel)
    axis.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend, or ``None`` where matplotlib is not installed (tables only)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def cached_label(peer: str, result: Dict[str, Any], spec: Optional[str], uncached: Optional[str] = None) -> str:
    """A row's pipeline cell: the peer's name, and for the cached row what it cached — ``cached (deepcache:3; 20 of
    30 steps skipped; 2.10 × defaults)`` (the steps of its timed call at the full step count; with ``uncached``, its
    speed-up end to end over that row). ``spec``: the run's ``--cache``, where the row itself has none (it failed)."""
    if "computed" not in result and "cache" not in result and spec is None:
        return peer
    about = [str(result.get("cache", spec))]
    if "computed" in result:
        about.append(f"{result['skipped_steps']} of {len(result['computed'])} steps skipped")
    if uncached and result.get("speedup_vs_uncached"):
        about.append(f"{result['speedup_vs_uncached']:.2f} × {uncached}")
    return f"{peer} ({'; '.join(about)})"


def write_report(results: Dict[str, Any], out: Path) -> None:
    """results.json → results.md (table) and results.png (chart); a cached row names its cache, the steps it skipped
    and its speed-up over "defaults" (:func:`cached_label`)."""
    env = results["environment"]
    spec = results.get("cache")
    lines = [
        f"# Benchmark: {env.get('device')}",
        "",
        f"`{env.get('command')}` — {env.get('date')}; torch {env.get('torch')} (CUDA {env.get('cuda')}), onnxruntime "
        f"{env.get('onnxruntime')}, diffusers {env.get('diffusers')}, transformers {env.get('transformers')}; "
        f"{results['steps']} DDIM steps, CFG (batch 2), median of {results['runs']} runs after {results['warmup']} "
        + (
            f"warm-up in each of {results['repeats']} processes per peer (peer order rotated each time), then the "
            "median over the processes"
            if results.get("repeats", 1) > 1
            else "warm-up"
        )
        + "; SDXL guidance 5; LCM 4 steps (LCM scheduler, guidance embedded, batch 1); Turbo 4 Euler-ancestral "
        "trailing steps, guidance 0. Where diffusers has no numpy pipeline (SDXL, LCM), × and diff are against "
        "optimum-onnx."
        + (
            f" cached: defaults with the step cache `{spec}` (`pipe.enable_cache`), every row of a configuration on "
            "the same files (the step-cache export); the steps it skipped are those of a timed call at the full step "
            "count, × defaults its speed-up end to end."
            if spec
            else ""
        ),
        "",
        "| model | dtype | export | pipeline | end-to-end ms | per-step ms | × numpy | step / GPU floor "
        "| step / own graph | GPU step / own graph | peak GPU MiB | H↔D bytes/step | max diff vs numpy | load s "
        "| first image s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        floor = row.get("floor", {}).get("per_step_ms")
        numpy_ms = row["peers"].get(row.get("reference", "numpy"), {}).get("end_to_end_ms")
        for peer, result in row["peers"].items():
            name = cached_label(peer, result, spec, "defaults") if peer == "cached" else peer
            label = f"| {row['model']} {row['size']}² | {row['dtype']} | {row['export']} | {name} |"
            if "skipped" in result:
                lines.append(f"{label} — ({result['skipped']}) |" + " |" * 10)
                continue
            if "error" in result:
                lines.append(f"{label} failed: {result['error'].strip().splitlines()[-1][:120]} |" + " |" * 10)
                continue
            speedup = f"{numpy_ms / result['end_to_end_ms']:.2f}" if numpy_ms else ""
            vs_floor = f"{result['per_step_ms'] / floor:.3f}" if floor else ""
            own = result.get("per_step_over_own_floor")
            vs_own = "" if own is None else f"{own:.3f} ({result['own_floor_ms']:.2f})"
            gpu_own = result.get("gpu_step_over_own_floor")
            gpu_vs_own = "" if gpu_own is None else f"{gpu_own:.3f} ({result['gpu_step_ms']:.3f})"
            copies = result["htod_bytes_per_step"] + result["dtoh_bytes_per_step"]
            diff = result.get("max_abs_diff_vs_numpy")
            cold = " | ".join(
                f"{result[key]:.2f}" if result.get(key) is not None else "" for key in ("load_s", "first_image_s")
            )
            lines.append(
                f"{label} {result['end_to_end_ms']:.1f} | {result['per_step_ms']:.2f} | {speedup} | {vs_floor} | "
                f"{vs_own} | {gpu_vs_own} | {result['peak_memory_mib']:.0f} | {copies:,.0f} | "
                f"{'' if diff is None else f'{diff:.2e}'} | {cold} |"
            )
        if floor:
            lines.append(
                f"| {row['model']} {row['size']}² | {row['dtype']} | {row['export']} | GPU floor (UNet graph "
                f"replays, a process of its own) | | {floor:.2f} | | 1.000 |" + " |" * 7
            )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    plt = _pyplot()
    if plt is None:
        return
    labels, values, colors = [], [], []
    palette = {
        "numpy": "#999999",
        "optimum": "#e69f00",
        "accelerated": "#d55e00",
        "defaults": "#0072b2",
        "binding": "#56b4e9",
        "graph": "#009e73",
        "torch": "#cc79a7",
        "cached": "#f0e442",
    }
    for row in results["rows"]:
        for peer, result in row["peers"].items():
            if "error" not in result and "skipped" not in result:
                labels.append(f"{row['model']} {row['dtype']} {row['export']}\n{peer}")
                values.append(result["end_to_end_ms"])
                colors.append(palette.get(peer, "#333333"))
    _bar_chart(
        plt,
        labels,
        values,
        colors,
        f"end-to-end ms ({results['steps']} steps, CFG), lower is better",
        f"optimum-iobinding benchmark — {env.get('device')}",
        out / "results.png",
    )


def write_mixed_report(results: Dict[str, Any], out: Path) -> None:
    """mixed.json → mixed.md (tables) and mixed.png (per-call ms per round)."""
    env = results["environment"]
    batches = [str(b) for b in results["batches"]]
    cycles = results.get("cycles", 1)
    timed_apart = any("import_s" in peer for row in results["rows"] for peer in row["peers"].values())
    imports = " (imports apart)" if timed_apart else " (imports included)"
    lines = [
        f"# Mixed batch sizes: {env.get('device')}",
        "",
        f"`{env.get('command')}` — {env.get('date')}; torch {env.get('torch')}, onnxruntime {env.get('onnxruntime')}, "
        f"diffusers {env.get('diffusers')}. Batch sizes {' → '.join(batches)} in turn, {results['steps']} DDIM steps "
        f"each, CFG, {results['rounds']} rounds"
        + (
            f" of {cycles} passes over them (a round's ms: the median of its {cycles} calls per batch size)"
            if cycles > 1
            else ", one call per batch size each"
        )
        + f", one process per peer. Cold start: load{imports}, then a first batch-1 image of "
        f"{results['first_steps']} steps. Memory: device-wide peak above the process's idle.",
        "",
        "| model | pipeline | "
        + " | ".join(f"round {r + 1} ms (b{'/b'.join(batches)})" for r in range(results["rounds"]))
        + " | worst later round / best | peak MiB | × numpy MiB | sessions created after round 1 | load s | warm-up s "
        "| first image s |",
        "|---|---|" + "---|" * results["rounds"] + "---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        numpy_mib = row["peers"].get("numpy", {}).get("peak_memory_mib")
        for peer, result in row["peers"].items():
            label = f"| {row['model']} {row['dtype']} {row['export']} {row['size']}² | {peer} |"
            if "error" in result:
                lines.append(f"{label} failed: {result['error'].strip().splitlines()[-1][:120]} |")
                continue
            summary = mixed_summary(result)
            rounds = " | ".join(" / ".join(f"{r[b]:.0f}" for b in batches) for r in result["per_round_ms"])
            worst = max(summary["worst_later_round_ratio"].values())
            ratio = f"{result['peak_memory_mib'] / numpy_mib:.2f}" if numpy_mib else ""
            created = summary["sessions_created_after_round_1"]
            warm = f"{result['warmup_s']:.1f}" if result.get("warmup_s") is not None else ""
            lines.append(
                f"{label} {rounds} | {worst:.3f} | {result['peak_memory_mib']:.0f} | {ratio} | "
                f"{'' if created is None else created} | {result['load_s']:.1f} | {warm} | "
                f"{result['first_image_s']:.2f} |"
            )
    (out / "mixed.md").write_text("\n".join(lines) + "\n")
    plt = _pyplot()
    if plt is None:
        return
    for row in results["rows"]:
        figure, axis = plt.subplots(figsize=(10, 4))
        for peer, result in row["peers"].items():
            if "error" in result:
                continue
            series = [r[b] for r in result["per_round_ms"] for b in batches]
            axis.plot(range(len(series)), series, marker="o", label=peer)
        axis.set_xticks(
            range(len(batches) * results["rounds"]),
            [f"r{r + 1} b{b}" for r in range(results["rounds"]) for b in batches],
            fontsize=7,
        )
        axis.set_ylabel("ms per call")
        axis.set_yscale("log")
        axis.set_title(f"mixed batch sizes — {row['model']} {row['dtype']} {row['export']} — {env.get('device')}")
        axis.legend()
        figure.tight_layout()
        figure.savefig(out / f"mixed-{row['model']}-{row['dtype']}-{row['export']}.png", dpi=120)


def stream_row_label(row: Dict[str, Any]) -> str:
    """``1 step, tiny VAE`` / ``2 steps, stream batch, full VAE`` / ``2 steps in turn, full VAE``; a feature row's
    with its feature after (:func:`stream_feature_label`)."""
    steps = row["unet_steps"]
    batching = "" if steps == 1 else (", stream batch" if row["stream_batch"] else " in turn")
    label = f"{steps} step{'s' if steps > 1 else ''}{batching}, {row['vae']} VAE"
    return f"{label}, {stream_feature_label(row)}" if "feature" in row else label


def stream_feature_label(row: Dict[str, Any]) -> str:
    """What a feature row of the stream adds, from its settings: ``guidance 1.5 (cfg_type self)`` /
    ``similarity filter 0.98, still clip`` / ``ControlNet, fixed control image`` / ``2 ControlNets, control image per
    frame`` / ``IP-Adapter (4 image tokens, scale 1), image prompt per frame``; several of them joined by commas."""
    parts = []
    if row.get("cfg_type") is not None:
        parts.append(f"guidance {row.get('guidance_scale', 0.0):g} (cfg_type {row['cfg_type']})")
    if row.get("similarity_threshold") is not None:
        parts.append(f"similarity filter {row['similarity_threshold']:g}, {row.get('clip', 'moving')} clip")
    if row.get("control") is not None:
        count = row.get("controlnets", 1)
        nets = "ControlNet" if count == 1 else f"{count} ControlNets"
        image = "fixed control image" if row["control"] == "fixed" else "control image per frame"
        parts.append(f"{nets}, {image}")
    if row.get("image_prompt") is not None:
        adapter = (
            f"IP-Adapter ({row.get('ip_adapter_tokens', 4)} image tokens, scale {row.get('ip_adapter_scale', 1.0):g})"
        )
        prompt = "fixed image prompt" if row["image_prompt"] == "fixed" else "image prompt per frame"
        parts.append(f"{adapter}, {prompt}")
    return ", ".join(parts) or str(row["feature"])


def _plain_stream_row(results: Dict[str, Any], row: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The row without a feature of ``row``'s configuration and VAE: what a feature row adds to."""
    keys = ("steps", "strength", "stream_batch", "vae")
    for other in results["rows"]:
        if "feature" not in other and all(other[key] == row[key] for key in keys):
            return other
    return None


def _torch_tiny_p50(results: Dict[str, Any], row: Dict[str, Any]) -> Any:
    """The torch tiny-VAE peer's p50 at ``row``'s step count (the stream batch does not change its work)."""
    for other in results["rows"]:
        if "feature" not in other and other["vae"] == "tiny" and other["unet_steps"] == row["unet_steps"]:
            torch_result = other["peers"].get("torch", {})
            if "p50_ms" in torch_result:
                return torch_result["p50_ms"]
    return None


def _stream_floor_cell(result: Dict[str, Any]) -> str:
    """A floor result's parts: ``floor (encoder 2.00 + UNet 1 × 5.00 at batch 1 + decoder 1.00)``, with ControlNets
    ``floor (encoder 2.00 + 1 × (ControlNet 3.00 + UNet 5.00) at batch 1 + decoder 1.00)``, with an image encoder
    (an image prompt per frame) ``floor (encoder 2.00 + image encoder 3.00 + UNet 1 × 5.00 at batch 1 + …)``."""
    parts = result["parts_ms"]
    nets = [name for name in parts if name not in ("vae_encoder", "image_encoder", "unet", "vae_decoder")]
    if nets:
        models = " + ".join([*(f"ControlNet {parts[name]:.2f}" for name in nets), f"UNet {parts['unet']:.2f}"])
        step = f"{result['unet_calls']} × ({models})"
    else:
        step = f"UNet {result['unet_calls']} × {parts['unet']:.2f}"
    if "image_encoder" in parts:
        step = f"image encoder {parts['image_encoder']:.2f} + {step}"
    return (
        f"floor (encoder {parts['vae_encoder']:.2f} + {step} at batch {result['unet_batch']} + decoder "
        f"{parts['vae_decoder']:.2f})"
    )


def _stream_feature_table(results: Dict[str, Any]) -> List[str]:
    """stream.md's lines of the feature rows (none without one): per feature ours and the floor, ours' frame time
    against the plain row's of the same configuration, and the share of frames the similarity filter skipped; below
    the table, the mean time of ``update_image_prompt`` alone where a row gave an image prompt per frame."""
    rows = [row for row in results["rows"] if "feature" in row]
    if not rows:
        return []
    lines = [
        "",
        "Features (`--stream-features`), each on its configuration with the tiny VAE, measured by ours and the floor "
        "alone: guidance 1.5, classifier-free (`cfg_type full`: a negative-prompt row beside the latent's) and "
        "StreamDiffusion's residual guidance (`self`: no extra row; `initialize`: one negative-prompt row); the "
        "similarity filter at 0.98 on a still clip (one frame again and again) and on a moving one (every frame new); "
        "one ControlNet (random weights) with a fixed control image or one given with each frame (frames/s then from "
        "calls one after another, not `frames()`); one IP-Adapter (random weights) with a fixed image prompt or a new "
        "PIL image given to `update_image_prompt` before each frame (its time counted in the frame's; frames/s from "
        "calls one after another). Frame ms / plain: ours' 1000 / frames/s against the plain row's "
        "of the same configuration and VAE. Skipped: the frames/s run's frames the similarity filter skipped (each "
        "gives the last output again). Floor: the prepared stream's own models (its ControlNets, its UNet at the "
        "guidance's batch with the image prompt's keys and values, the image encoder where each frame brings an image "
        "prompt), each from its own CUDA graph, back to back.",
        "",
        "| feature | configuration | pipeline | p50 ms | p99 ms | frames/s | / floor | frame ms / plain | skipped |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        start = f"| {row['feature']} | {stream_row_label(row)} |"
        floor = row["peers"].get("floor", {}).get("frame_ms")
        plain = _plain_stream_row(results, row)
        plain_fps = (plain or {}).get("peers", {}).get("ours", {}).get("fps")
        for peer, result in row["peers"].items():
            if "skipped" in result:
                lines.append(f"{start} {peer} | — ({result['skipped']}) | | | | | |")
                continue
            if "error" in result:
                reason = result["error"].strip().splitlines()[-1][:120] if result["error"] else "no reason given"
                lines.append(f"{start} {peer} | failed: {reason} | | | | | |")
                continue
            if peer == "floor":
                lines.append(
                    f"{start} {_stream_floor_cell(result)} | {result['frame_ms']:.2f} | | {result['fps']:.1f} "
                    "| 1.00 | | |"
                )
                continue
            vs_floor = f"{result['p50_ms'] / floor:.2f}" if floor else ""
            vs_plain = f"{plain_fps / result['fps']:.2f}" if plain_fps else ""
            skipped = (
                f"{100 * result['skipped_share']:.1f} % ({result['skipped_frames']} of {result['frames']})"
                if "skipped_share" in result
                else ""
            )
            lines.append(
                f"{start} {peer} | {result['p50_ms']:.2f} | {result['p99_ms']:.2f} | {result['fps']:.1f} "
                f"| {vs_floor} | {vs_plain} | {skipped} |"
            )
    updates = [(row, row["peers"]["ours"]) for row in rows if "update_image_prompt_ms" in row["peers"].get("ours", {})]
    if updates:
        lines.append("")
        for row, result in updates:
            share = result["update_image_prompt_ms"] * result["fps"] / 10
            lines.append(
                f"`update_image_prompt` alone ({row['feature']}): {result['update_image_prompt_ms']:.2f} ms a call, "
                f"mean of {result['frames']} calls, each waited for (the image prompt's preprocessing on the CPU, the "
                f"image encoder, the keys and values of every layer); {share:.0f} % of ours' frame time at its frames/s."
            )
    return lines


def write_stream_report(results: Dict[str, Any], out: Path) -> None:
    """stream.json → stream.md (per-frame latency, frames/s, ratios to the floor and to torch with the tiny VAE; the
    feature rows' own table, :func:`_stream_feature_table`; the video file's three figures) and stream.png (frames/s
    per peer and configuration)."""
    env = results["environment"]
    lines = [
        f"# Stream: {env.get('device')}",
        "",
        f"`{env.get('command')}` — {env.get('date')}; torch {env.get('torch')} (CUDA {env.get('cuda')}), onnxruntime "
        f"{env.get('onnxruntime')}, diffusers {env.get('diffusers')}. {results['model']} architecture "
        f"({results['dtype']} {results['export']} export; the tiny VAE TAESD-shaped), {results['size']}², batch 1, "
        f"guidance 0, Euler ancestral trailing; 1 step: 2 steps at strength 0.5, 2 steps: 4 at 0.5. Latency: "
        f"{results['frames']} frames, each waited for on the device before the next, after {results['warmup']} "
        "warm-up frames; frames/s: ours back to back through `frames()` (CUDA frames in and out), the others "
        "1000 / mean latency (one frame at a time). In a stream batch a frame comes out k − 1 frames later. Floor: "
        "each component's own CUDA graph replayed back to back (VAE encoder + UNet + VAE decoder). One process per "
        "peer.",
        "",
        "| configuration | pipeline | p50 ms | p99 ms | frames/s | / floor | torch tiny-VAE p50 / this p50 |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        if "feature" in row:
            continue
        label = stream_row_label(row)
        floor = row["peers"].get("floor", {}).get("frame_ms")
        torch_tiny = _torch_tiny_p50(results, row)
        for peer, result in row["peers"].items():
            if peer == "video":
                continue
            if "skipped" in result:
                lines.append(f"| {label} | {peer} | — ({result['skipped']}) | | | | |")
                continue
            if "error" in result:
                lines.append(f"| {label} | {peer} | failed: {result['error'].strip().splitlines()[-1][:120]} | | | | |")
                continue
            if peer == "floor":
                lines.append(
                    f"| {label} | {_stream_floor_cell(result)} | {result['frame_ms']:.2f} | | {result['fps']:.1f} "
                    "| 1.00 | |"
                )
                continue
            vs_floor = f"{result['p50_ms'] / floor:.2f}" if floor else ""
            vs_torch = f"{torch_tiny / result['p50_ms']:.2f}" if torch_tiny else ""
            lines.append(
                f"| {label} | {peer} | {result['p50_ms']:.2f} | {result['p99_ms']:.2f} | {result['fps']:.1f} "
                f"| {vs_floor} | {vs_torch} |"
            )
    lines += _stream_feature_table(results)
    videos = [(row, row["peers"]["video"]) for row in results["rows"] if "video" in row["peers"]]
    if videos:
        lines += [
            "",
            f"A {results['size']}² H.264 video through the `stream` command (decode → stream → encode, its frame "
            "loop; load and prepare apart), against the same decoded frames through the stream from memory (numpy in "
            "and out) and ours with CUDA frames, and the codec alone (decode, then encode, no model):",
            "",
            "| configuration | frames | codec alone frames/s | stream command frames/s | in memory, host frames "
            "frames/s | in memory, CUDA frames frames/s |",
            "|---|---|---|---|---|---|",
        ]
        for row, video in videos:
            label = stream_row_label(row)
            if "command_fps" not in video:
                reason = video.get("error") or video.get("skipped") or "no figures in its result"
                lines.append(f"| {label} | failed: {reason.strip().splitlines()[-1][:120]} | | | | |")
                continue
            ours = row["peers"].get("ours", {}).get("fps")
            lines.append(
                f"| {label} | {video['frames']} | {video['codec_fps']:.1f} | {video['command_fps']:.1f} | "
                f"{video['in_memory_host_fps']:.1f} | {'' if ours is None else f'{ours:.1f}'} |"
            )
    (out / "stream.md").write_text("\n".join(lines) + "\n")
    plt = _pyplot()
    if plt is None:
        return
    labels, values, colors = [], [], []
    palette = {"ours": "#009e73", "numpy": "#999999", "torch": "#cc79a7", "floor": "#0072b2"}
    for row in results["rows"]:
        for peer, result in row["peers"].items():
            if peer in palette and "fps" in result:
                labels.append(f"{stream_row_label(row)}\n{peer}")
                values.append(result["fps"])
                colors.append(palette[peer])
    _bar_chart(
        plt,
        labels,
        values,
        colors,
        f"frames/s at {results['size']}², batch 1, higher is better",
        f"stream — {results['model']} — {env.get('device')}",
        out / "stream.png",
    )


def transformer_depth_label(row: Dict[str, Any]) -> str:
    """What a transformer row measured: ``full model`` or ``4 of 24 blocks (not the full model)`` (FLUX.1: double and
    single blocks), with the text encoders' depth where ``--text-layers`` shrank them."""
    full = TRANSFORMER_BLOCKS.get(row["model"])
    if row.get("blocks") is None or full is None:
        label = "full model"
    elif full[1]:
        label = (
            f"{row['blocks'][0]} of {full[0]} double + {row['blocks'][1]} of {full[1]} single blocks "
            "(not the full model)"
        )
    else:
        label = f"{row['blocks'][0]} of {full[0]} blocks (not the full model)"
    if row.get("text_layers") is not None:
        label += f", text encoders ≤ {row['text_layers']} layers"
    return label


def _reason(result: Dict[str, Any]) -> str:
    """A failed or skipped peer's one line: its reason, or the last line of its error."""
    if "skipped" in result:
        return f"— ({result['skipped']})"
    return f"failed: {str(result['error']).strip().splitlines()[-1][:160]}"


# what the transformer report says of the torch peers, per device (transformer_peers.load_transformer_peer)
TORCH_PEERS_ON = {
    "cuda": "torch/compile: diffusers' pipeline in bf16 (on the GPU its random weights are drawn there with the same "
    "seed: the images are not compared).",
    "cpu": "torch: diffusers' pipeline in float32 with the export's own weights (the images are compared).",
}


# how the transformer scenario measures a step, per device (transformer_peers.step_ms)
PER_STEP_METHODS = {
    "cuda": "(median at the recipe's steps − median at its short step count) / the steps between",
    "cpu": "from the first step's end to the last's inside each timed call at the recipe's steps, per step (median)",
}


def write_transformer_report(results: Dict[str, Any], out: Path) -> None:
    """transformer.json → transformer.md (per model and peer: end-to-end and per-step ms, step / GPU floor, ours ÷
    the peer end to end, peak memory, load, first image, compile seconds, difference from ours' image; every row
    names the transformer's depth; a cached row its cache and the steps it skipped, :func:`cached_label`) and
    transformer.png (end-to-end ms, where matplotlib is installed)."""
    env = results["environment"]
    spec = results.get("cache")
    lines = [
        f"# Transformers: {env.get('device')}",
        "",
        f"`{env.get('command')}` — {env.get('date')}; torch {env.get('torch')} (CUDA {env.get('cuda')}), onnxruntime "
        f"{env.get('onnxruntime')}, diffusers {env.get('diffusers')}, transformers {env.get('transformers')}. Random "
        f"weights, batch 1, {results['dtype']} {results['export']} export on {results['device']}; median of "
        f"{results['runs']} runs after {results['warmup']} warm-up; per-step ms: "
        + PER_STEP_METHODS[results["device"]]
        + ". SD3.5 Medium: 28 steps, CFG 7 (transformer batch 2), "
        "T5 256 tokens; FLUX.1 schnell: 4 steps, guidance 0, T5 256; FLUX.1 dev: 28 steps, embedded guidance 3.5, "
        f"T5 512. {TORCH_PEERS_ON[results['device']]} Floor: our transformer's CUDA graph replayed back to back, "
        "a process of its own. One process per peer."
        + (
            f" cached: ours with the step cache `{spec}` (`pipe.enable_cache`) on the same folder; the steps it "
            "skipped are those of a timed call at the recipe's steps, and ours ÷ this is its speed-up end to end."
            if spec
            else ""
        ),
        "",
        "| model | transformer | pipeline | end-to-end ms | per-step ms | step / floor | ours ÷ this (end to end) "
        "| peak GPU MiB | load s | first image s | compile s | max diff vs ours |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        depth = transformer_depth_label(row)
        label = f"| {row['model']} {row['size']}² | {depth} |"
        if "export_error" in row:
            lines.append(f"{label} export | failed: {row['export_error'].strip().splitlines()[-1][:160]} |" + " |" * 8)
            continue
        floor = row["peers"].get("floor", {}).get("per_step_ms")
        ours = row["peers"].get("ours", {}).get("end_to_end_ms")
        for peer, result in row["peers"].items():
            name = cached_label(peer, result, spec) if peer == "cached" else peer
            if "per_step_ms" not in result:
                lines.append(f"{label} {name} | {_reason(result)} |" + " |" * 8)
                continue
            if peer == "floor":
                lines.append(
                    f"{label} GPU floor (transformer graph replays, batch "
                    f"{result['graph_inputs']['hidden_states'][0]}) | | {floor:.2f} | 1.000 |" + " |" * 6
                )
                continue
            vs_floor = f"{result['per_step_ms'] / floor:.3f}" if floor else ""
            vs_ours = f"{ours / result['end_to_end_ms']:.2f}" if ours else ""
            numbers = [result.get(key) for key in ("peak_memory_mib", "load_s", "first_image_s", "compile_s")]
            cells = " | ".join(
                "" if value is None else (f"{value:.0f}" if i == 0 else f"{value:.1f}")
                for i, value in enumerate(numbers)
            )
            diff = result.get("max_abs_diff_vs_ours")
            lines.append(
                f"{label} {name} | {result['end_to_end_ms']:.1f} | {result['per_step_ms']:.2f} | {vs_floor} | "
                f"{vs_ours} | {cells} | {'' if diff is None else f'{diff:.2e}'} |"
            )
    (out / "transformer.md").write_text("\n".join(lines) + "\n")
    plt = _pyplot()
    if plt is None:
        return
    labels, values = [], []
    for row in results["rows"]:
        for peer, result in row["peers"].items():
            if "end_to_end_ms" in result:
                blocks = "" if row.get("blocks") is None else f" ({transformer_depth_label(row).split(' (')[0]})"
                labels.append(f"{row['model']}{blocks}\n{peer}")
                values.append(result["end_to_end_ms"])
    _bar_chart(
        plt,
        labels,
        values,
        "#0072b2",
        "end-to-end ms, batch 1, lower is better",
        f"transformers — {env.get('device')}",
        out / "transformer.png",
    )


# what the video report says of each model (bench.zoo's keys), and of the torch peers per device
VIDEO_MODEL_TITLES = {
    "wan2.1-t2v-1.3b": "Wan 2.1 T2V 1.3B",
    "wan2.2-t2v-a14b": "Wan 2.2 T2V A14B",
    "tiny-wan": "the tiny random Wan model",
}
VIDEO_TORCH_PEERS_ON = {
    "cuda": "torch/compile: diffusers' WanPipeline as its model card runs it, the transformer and UMT5 in bf16 (the "
    "modules diffusers and transformers keep in float32 kept so), the VAE in float32; their random weights are drawn "
    "on the device with the export's seed: the frames are not compared.",
    "cpu": "torch: diffusers' WanPipeline in float32 with the export's own weights (the frames are compared).",
}


def video_depth_label(row: Dict[str, Any]) -> str:
    """``30 of 30 blocks (the full transformer)`` or ``4 of 30 blocks (not the full model)``."""
    blocks, full = row.get("blocks") or row["full_blocks"], row["full_blocks"]
    return f"{blocks} of {full} blocks" + (" (the full transformer)" if blocks == full else " (not the full model)")


def latent_tokens(row: Dict[str, Any]) -> int:
    """The transformer's tokens at a row's size: latent frames × (latent rows / 2) × (latent columns / 2)."""
    return ((row["num_frames"] - 1) // 4 + 1) * (row["height"] // 16) * (row["width"] // 16)


def _cells(result: Dict[str, Any], keys: Sequence[str], digits: Dict[str, int]) -> str:
    """``result``'s values of ``keys``, each with its number of decimals (0 by default), empty where absent."""
    return " | ".join("" if result.get(key) is None else f"{result[key]:.{digits.get(key, 0)}f}" for key in keys)


def write_video_report(results: Dict[str, Any], out: Path) -> None:
    """video.json → video.md (text to video: per peer end to end, per step, step / floor, ours ÷ the peer, the VAE
    decode of the frames, the recipe's step count at the measured step cost, memory, load, first video, compile
    seconds, the frames' range; the MLPerf shape: ms per guided transformer call, per block, the full depth at that
    per-block cost) and video.png (end-to-end seconds, where matplotlib is installed)."""
    env = results["environment"]
    device = results["device"]
    on_cuda = device == "cuda"
    lines = [
        f"# Video: {env.get('device')}",
        "",
        f"`{env.get('command')}` — {env.get('date')}; torch {env.get('torch')} (CUDA {env.get('cuda')}), onnxruntime "
        f"{env.get('onnxruntime')}, diffusers {env.get('diffusers')}, transformers {env.get('transformers')}. Random "
        f"weights; one process per peer; exports made on the host's CPUs"
        + (" beside the GPU, while diffusers' peers measured." if results.get("exports_ahead") else ", first."),
    ]
    rows = {row["table"]: row for row in results["rows"]}
    video = rows.get("video")
    if video is not None:
        title = VIDEO_MODEL_TITLES.get(video["model"], video["model"])
        text = (
            f"UMT5-XXL's encoder at full width with {video['text_layers']} of its 24 layers, "
            if video.get("text_layers")
            else ""
        )
        ran = set(video["peers"])
        about = [
            f"{title}'s architecture: the transformer with {video_depth_label(video)}, {text}Wan's VAE; "
            f"{video['height']}×{video['width']}, {video['num_frames']} frames ({latent_tokens(video):,} tokens), "
            f"batch 1, {results['steps']} steps timed of the recipe's {video['recipe_steps']} (UniPC, flow shift 3), "
            f"guidance {video['guidance']:g} (two transformer rows a step), UMT5 {video['max_sequence_length']} "
            "tokens.",
            f"ours: {family('wan').class_name}'s defaults on a {results['dtype']} {results['export']} export (UMT5 "
            f"float32, the VAE {'float16' if results.get('vae_dtype') == 'fp16' else 'float32'}), {device}.",
        ]
        if ran & {"torch", "compile"}:
            about.append(VIDEO_TORCH_PEERS_ON[device])
        if "compile" in ran:
            about.append(
                f'compile: `torch.compile(pipe.transformer, mode="{results["compile_mode"]}")`; compile s: its first '
                "video less a warm one."
            )
        about += [
            f"Median of {results['runs']} timed call{'s' if results['runs'] > 1 else ''} after the first video and "
            f"{results['warmup']} warm-up; per step: from the first step's end to the last's in each timed call, per "
            "step between ("
            + ("CUDA events on the pipeline's stream" if on_cuda else "the host's clock")
            + "); VAE decode: the last call's latents decoded again alone (ours: the chunk graphs, a latent frame a "
            f"call; diffusers: `vae.decode`); at {video['recipe_steps']} steps: an estimate, end to end + "
            f"({video['recipe_steps']} − {results['steps']}) × per step.",
        ]
        if "floor" in ran:
            about.append("Floor: our transformer's CUDA graph replayed back to back, a process of its own.")
        if on_cuda:
            about.append(
                "Memory: the device's peak above the process's idle (ORT's arenas included), and torch's "
                "`max_memory_allocated`."
            )
        lines += [
            "",
            f"## Text to video: {title}",
            "",
            " ".join(about),
            "",
            f"| pipeline | end-to-end s | per-step ms | step / floor | ours ÷ this (end to end) | VAE decode s "
            f"| at {video['recipe_steps']} steps s (estimate) | peak GPU MiB | torch max allocated MiB | load s "
            "| first video s | compile s | frames min / max (non-finite) | max diff vs ours |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        if "export_error" in video:
            lines.append(f"| export | {_reason({'error': video['export_error']})} |" + " |" * 12)
        floor = video["peers"].get("floor", {}).get("per_step_ms")
        ours = video["peers"].get("ours", {}).get("end_to_end_s")
        for peer, result in video["peers"].items():
            if peer == "floor" and floor is not None:
                lines.append(
                    f"| GPU floor (transformer graph replays, {result['graph_inputs']['hidden_states'][0]} rows) | | "
                    f"{floor:.1f} | 1.000 |" + " |" * 10
                )
                continue
            if "end_to_end_s" not in result:
                lines.append(f"| {peer} | {_reason(result)} |" + " |" * 12)
                continue
            step = result.get("per_step_ms")
            vs_floor = f"{step / floor:.3f}" if floor and step else ""
            vs_ours = f"{ours / result['end_to_end_s']:.2f}" if ours else ""
            stats = result.get("frame_stats") or {}
            frames = f"{stats['min']:.2f} / {stats['max']:.2f} ({stats['non_finite']:.0%})" if "min" in stats else ""
            diff = result.get("max_abs_diff_vs_ours")
            lines.append(
                f"| {peer} | {result['end_to_end_s']:.3f} | {'' if step is None else f'{step:.1f}'} | {vs_floor} | "
                f"{vs_ours} | {result['vae_decode_s']:.3f} | "
                + _cells(
                    result,
                    (
                        "recipe_steps_estimate_s",
                        "peak_memory_mib",
                        "torch_max_allocated_mib",
                        "load_s",
                        "first_video_s",
                        "compile_s",
                    ),
                    {"recipe_steps_estimate_s": 1, "load_s": 1, "first_video_s": 1, "compile_s": 1},
                )
                + f" | {frames} | {'' if diff is None else f'{diff:.2e}'} |"
            )
    mlperf = rows.get("mlperf")
    if mlperf is not None:
        title = VIDEO_MODEL_TITLES.get(mlperf["model"], mlperf["model"])
        blocks, full = mlperf["blocks"], mlperf["full_blocks"]
        heading = (
            "The MLPerf Inference v6.0 shape's code path, on the tiny random Wan model's transformer"
            if mlperf["model"] == "tiny-wan"
            else f"The MLPerf Inference v6.0 shape: {title}'s transformer"
        )
        lines += [
            "",
            f"## {heading}",
            "",
            f"The transformer alone with {video_depth_label(mlperf)}, full width; {mlperf['height']}×{mlperf['width']}, "
            f"{mlperf['num_frames']} frames ({latent_tokens(mlperf):,} tokens), {mlperf['rows']} rows (a guided "
            f"step), UMT5 states of {mlperf['max_sequence_length']} tokens, random inputs. ours: the "
            f"{results['dtype']} {results['export']} export through `IOBindingORTModel`"
            + (" with its CUDA graph (graph replay: the graph alone, back to back)" if on_cuda else "")
            + "; torch/compile: diffusers' `WanTransformer3DModel` in "
            + ("bf16" if on_cuda else "float32")
            + f', compiled with mode "{results["compile_mode"]}". ms per call: median of {results["runs"]} after '
            f"the first call and {results['warmup']} warm-up"
            + (" (CUDA events)" if on_cuda else "")
            + f". × {full} blocks: an estimate, not a measurement (the per-block cost of the reduced transformer, its "
            f"embeddings and head counted in, × {full}"
            + ("; Wan 2.2 A14B runs one of its two experts a step)." if mlperf["model"] == "wan2.2-t2v-a14b" else ")."),
            "",
            f"| pipeline | ms a call ({blocks} blocks) | ms per block | × {full} blocks s (estimate) | ours ÷ this "
            "| graph replay ms | peak GPU MiB | torch max allocated MiB | load s | first call s | compile s |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        if "export_error" in mlperf:
            lines.append(f"| export | {_reason({'error': mlperf['export_error']})} |" + " |" * 9)
        ours = mlperf["peers"].get("ours", {}).get("step_ms")
        for peer, result in mlperf["peers"].items():
            if "step_ms" not in result:
                lines.append(f"| {peer} | {_reason(result)} |" + " |" * 9)
                continue
            vs_ours = f"{ours / result['step_ms']:.2f}" if ours else ""
            lines.append(
                f"| {peer} | {result['step_ms']:.1f} | {result['per_block_ms']:.1f} | "
                f"{result['full_depth_estimate_ms'] / 1000:.3f} | {vs_ours} | "
                + _cells(
                    result,
                    (
                        "graph_replay_ms",
                        "peak_memory_mib",
                        "torch_max_allocated_mib",
                        "load_s",
                        "first_call_s",
                        "compile_s",
                    ),
                    {"graph_replay_ms": 1, "load_s": 1, "first_call_s": 1, "compile_s": 1},
                )
                + " |"
            )
        estimates = [
            f"{peer} ≈ {result['full_depth_estimate_ms'] / 1000:.3f} s"
            for peer, result in mlperf["peers"].items()
            if "full_depth_estimate_ms" in result
        ]
        if estimates:
            lines += [
                "",
                f"At full depth ({full} blocks; an estimate from the per-block cost at {blocks}): a guided step "
                f"{', '.join(estimates)}.",
            ]
    (out / "video.md").write_text("\n".join(lines) + "\n")
    plt = _pyplot()
    if plt is None or video is None:
        return
    labels = [peer for peer, result in video["peers"].items() if "end_to_end_s" in result]
    if labels:
        _bar_chart(
            plt,
            labels,
            [video["peers"][peer]["end_to_end_s"] for peer in labels],
            "#0072b2",
            f"end-to-end s ({results['steps']} steps, {video['num_frames']} frames), lower is better",
            f"video — {VIDEO_MODEL_TITLES.get(video['model'], video['model'])} — {env.get('device')}",
            out / "video.png",
        )
