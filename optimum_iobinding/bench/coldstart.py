"""``--scenario coldstart``: the cold start (load, then the first image, in a fresh process) of the default pipeline
against the pipeline it replaces: SD 1.5's architecture (fused fp16, 512², 30 steps) against diffusers' numpy ONNX
pipeline, and FLUX.1 schnell's (2 double-stream and 4 single-stream blocks, T5 at 4 layers, fused fp16, 1024², 4
steps) against optimum-onnx's ``ORTFluxPipeline``. Each peer runs in a process of its own through the single and the
transformer scenarios' peers (one timed call after the first image: the cold start is what is compared); this module
gathers their cold-start fields into one table, with each peer's ratio to the baseline of its model.

The run has a cache folder of its own (``XDG_CACHE_HOME``, made empty): ours runs twice, the first load of its model
files, then a later load, which reads what the first one remembered (:mod:`optimum_iobinding.runtime.graph_refusals`:
a one-graph-session refusal is not asked again). Both rows are in the table."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

# model → (the scenario whose peers run it, (baseline, ours), the settings of the run)
COLDSTART_MODELS: Dict[str, Dict[str, Any]] = {
    "sd15": dict(scenario="single", peers=("numpy", "defaults"), steps=30),
    "flux-schnell": dict(scenario="transformer", peers=("optimum", "ours"), blocks=2, text_layers=4),
}
COLDSTART_FIELDS = ("import_s", "load_s", "first_image_s")
LATER_LOAD = " (a later load)"  # the suffix of ours' second row: its files loaded once before in this run


@contextlib.contextmanager
def fresh_cache_home() -> Iterator[str]:
    """An empty ``XDG_CACHE_HOME`` for the scenario's processes (they inherit it), removed and restored after."""
    before = os.environ.get("XDG_CACHE_HOME")
    with tempfile.TemporaryDirectory(prefix="coldstart-cache-") as folder:
        os.environ["XDG_CACHE_HOME"] = folder
        try:
            yield folder
        finally:
            if before is None:
                os.environ.pop("XDG_CACHE_HOME", None)
            else:
                os.environ["XDG_CACHE_HOME"] = before


def coldstart_rows(
    model: str, results: Dict[str, Any], base_cold: Optional[float] = None, suffix: str = "", only: Optional[str] = None
) -> List[Dict[str, Any]]:
    """The cold-start rows of ``model`` from its scenario's ``results`` (their rows' peers): per peer its imports (timed
    apart), load, first image, load + first image, and that sum over the baseline's (the model's first peer, or
    ``base_cold`` where the results hold no baseline); a peer that failed or was skipped keeps its reason. ``suffix``
    is added to the peers' names; ``only``: that peer's rows alone."""
    baseline, _ = COLDSTART_MODELS[model]["peers"]
    rows = []
    for row in results.get("rows", []):
        measured = row.get("peers", {})
        base = measured.get(baseline, {})
        if "first_image_s" in base:
            base_cold = base["load_s"] + base["first_image_s"]
        for peer, result in measured.items():
            if only is not None and peer != only:
                continue
            entry: Dict[str, Any] = {"model": model, "peer": peer + suffix, "baseline": baseline}
            if "first_image_s" not in result:
                entry["error"] = result.get("skipped") or result.get("error") or "no cold start measured"
            else:
                entry.update({field: result.get(field) for field in COLDSTART_FIELDS})
                entry["cold_s"] = result["load_s"] + result["first_image_s"]
                entry["over_baseline"] = entry["cold_s"] / base_cold if base_cold else None
            rows.append(entry)
    return rows


def coldstart_benchmark(
    models: List[str],
    work: Path,
    out: Path,
    optimum_pythonpath: Optional[str],
    timeout: int,
    compile_timeout: int,
    run_single: Callable[..., Dict[str, Any]],
    run_transformer: Callable[..., Dict[str, Any]],
    environment: Dict[str, Any],
    repeats: int = 1,
) -> Dict[str, Any]:
    """Each model's peers through its scenario (``run_single``: :func:`.cli.benchmark`; ``run_transformer``:
    :func:`.cli.transformer_benchmark`), their full results in ``out/MODEL/``, the cold-start table in
    ``out/coldstart.json`` and ``coldstart.md``. ``repeats`` > 1: the whole measure (first load beside the baseline,
    then a later load) that many times, each in a cache folder of its own and the first two peers' order swapped
    every other time, and for each peer the median of its runs (``run``: its number, or ``"median"``), each median's
    ratio that of the medians."""
    out.mkdir(parents=True, exist_ok=True)
    results: Dict[str, Any] = {"environment": environment, "scenario": "coldstart", "rows": []}
    for model in models:
        settings = COLDSTART_MODELS[model]
        baseline, ours = settings["peers"]
        done, rows = list(results["rows"]), []  # the models before, this model's
        for run in range(repeats):
            named = f"-run{run + 1}" if run else ""
            run_rows: List[Dict[str, Any]] = []
            with fresh_cache_home():
                for peers, folder, suffix in (
                    ([baseline, ours] if run % 2 == 0 else [ours, baseline], out / f"{model}{named}", ""),
                    ([ours], out / f"{model}{named}-later", LATER_LOAD),
                ):
                    if settings["scenario"] == "single":
                        scenario = run_single(
                            models=[model],
                            dtypes=["fp16"],
                            exports=["optimized"],
                            peers=peers,
                            steps=settings["steps"],
                            runs=1,
                            warmup=0,
                            work=work,
                            out=folder,
                            optimum_pythonpath=optimum_pythonpath,
                            timeout=timeout,
                        )
                    else:
                        scenario = run_transformer(
                            models=[model],
                            peers=peers,
                            dtype="fp16",
                            export="optimized",
                            blocks=settings["blocks"],
                            text_layers=settings["text_layers"],
                            runs=1,
                            warmup=0,
                            device="cuda",
                            work=work,
                            out=folder,
                            optimum_pythonpath=optimum_pythonpath,
                            timeout=timeout,
                            compile_timeout=compile_timeout,
                        )
                    base = next((row for row in run_rows if row["peer"] == baseline and "cold_s" in row), None)
                    run_rows += coldstart_rows(
                        model, scenario, base["cold_s"] if base else None, suffix, ours if suffix else None
                    )
            if repeats > 1:
                for row in run_rows:
                    row["run"] = run + 1
            rows += run_rows
            results["rows"] = [*done, *rows]
            (out / "coldstart.json").write_text(json.dumps(results, indent=2))
        if repeats > 1:
            results["rows"] = [*done, *rows, *median_rows(model, rows, baseline)]
            (out / "coldstart.json").write_text(json.dumps(results, indent=2))
    write_coldstart_report(results, out)
    return results


def median_rows(model: str, rows: List[Dict[str, Any]], baseline: str) -> List[Dict[str, Any]]:
    """Each peer's median over its measured runs (``run: "median"``, ``runs``: how many), its ratio the median's
    over the baseline's median; a peer with no measured run is left out."""
    medians: List[Dict[str, Any]] = []
    for peer in dict.fromkeys(row["peer"] for row in rows):
        measured = [row for row in rows if row["peer"] == peer and "cold_s" in row]
        if not measured:
            continue
        entry: Dict[str, Any] = {"model": model, "peer": peer, "baseline": baseline, "run": "median"}
        for field in (*COLDSTART_FIELDS, "cold_s"):
            values = [row[field] for row in measured if row.get(field) is not None]
            entry[field] = statistics.median(values) if values else None
        entry["runs"] = len(measured)
        medians.append(entry)
    base = next((row["cold_s"] for row in medians if row["peer"] == baseline), None)
    for entry in medians:
        entry["over_baseline"] = entry["cold_s"] / base if base else None
    return medians


def write_coldstart_report(results: Dict[str, Any], out: Path) -> None:
    """``coldstart.md``: one row per model and peer (and run, with the medians in bold, where it repeated)."""
    lines = [
        "# Cold start: load and first image, each peer in a fresh process",
        "",
        "SD 1.5's architecture (fused fp16, 512², 30 steps) against diffusers' numpy ONNX pipeline; FLUX.1 schnell's "
        "(2 + 4 blocks, T5 at 4 layers, fused fp16, 1024², 4 steps) against optimum-onnx. Imports are timed apart. "
        "Random weights. Ours twice: the first load of its files in a fresh cache folder, then a later load "
        "(what the first remembered: ORT's refusals of one graph session).",
        "",
        "| model | peer | imports s | load s | first image s | load + first s | ÷ baseline |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        peer = row["peer"]
        if row.get("run") == "median":
            peer = f"**{peer}: median of {row['runs']}**"
        elif row.get("run") is not None:
            peer = f"{peer}, run {row['run']}"
        row = {**row, "peer": peer}
        if "error" in row:
            reason = str(row["error"]).strip().splitlines()[-1][:120] if str(row["error"]).strip() else "?"
            lines.append(f"| {row['model']} | {row['peer']} | failed: {reason} |||||")
            continue
        ratio = f"{row['over_baseline']:.2f}" if row.get("over_baseline") is not None else ""
        imports = f"{row['import_s']:.2f}" if row.get("import_s") is not None else ""
        lines.append(
            f"| {row['model']} | {row['peer']} | {imports} | {row['load_s']:.2f} | {row['first_image_s']:.2f} | "
            f"{row['cold_s']:.2f} | {ratio} |"
        )
    (out / "coldstart.md").write_text("\n".join(lines) + "\n")
