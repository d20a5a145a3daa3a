"""The two jobs of ``benchmarks/ab_compare.sh`` that are easier in Python.

python3 benchmarks/ab_compare.py bench PACKAGE_ROOT ARGS...
    ``optimum-iobinding bench ARGS`` in this process, after checking that ``optimum_iobinding`` is imported from
    PACKAGE_ROOT (the folder that holds it): prints where it came from, exits 3 where it came from elsewhere.
    Run it with PYTHONSAFEPATH=1 from a folder without a package of that name (the current folder would come
    first on sys.path otherwise).
python3 benchmarks/ab_compare.py summary OUT [--tiny]
    OUT/summary.md and OUT/summary.json from OUT/<step>-<before|after>-<round>.json: per measure, before and
    after (the mean of the rounds), after / before, each round's values, and how far the rounds of the same code
    lay apart.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

# per step: its title, what its JSON is (the bench's own result of one peer process), and its measures as
# (key, label, better, tolerance): better "lower" or "higher"; tolerance: the allowed change, None to show it only
STEPS: Dict[str, Dict[str, Any]] = {
    "sd15": {
        "title": "SD1.5 architecture, fused fp16, 512², 30 DDIM steps, CFG: ours with defaults",
        "tiny_title": "(needs CUDA: not run with TINY=1)",
        "measures": [
            ("per_step_ms", "ms/step: ({steps}-step − {short}-step median) / {between}", "lower", 0.02),
            ("gpu_step_ms", "GPU ms/step inside calls (CUDA events)", "lower", 0.02),
            ("end_to_end_ms", "end to end ms, {steps} steps", "lower", None),
            ("own_floor_ms", "UNet graph replayed alone, ms (the card's drift)", "lower", None),
        ],
    },
    "sd35m": {
        "title": "SD3.5 Medium, 4 of 24 blocks, text encoders ≤ 4 layers, 1024², 28 steps, CFG 7: ours",
        "tiny_title": "tiny-sd3 on the CPU, fp32 plain (a check of the script, not a timing)",
        "measures": [
            ("per_step_ms", "ms/step: ({steps}-step − {short}-step median) / {between}", "lower", 0.02),
            ("end_to_end_ms", "end to end ms, {steps} steps", "lower", None),
            ("own_floor_ms", "transformer graph replayed alone, ms (the card's drift)", "lower", None),
        ],
    },
    "flux": {
        "title": "FLUX.1 schnell, 2 + 4 of 19 + 38 blocks, text encoders ≤ 4 layers, 1024², 4 steps: ours",
        "tiny_title": "tiny-flux on the CPU, fp32 plain (a check of the script, not a timing)",
        "measures": [
            ("per_step_ms", "ms/step: ({steps}-step − {short}-step median) / {between}", "lower", 0.02),
            ("end_to_end_ms", "end to end ms, {steps} steps", "lower", None),
            ("own_floor_ms", "transformer graph replayed alone, ms (the card's drift)", "lower", None),
        ],
    },
    "stream": {
        "title": "stream, SD-Turbo architecture + TAESD-shaped tiny VAE, fused fp16, 512², batch 1, 1 UNet step: ours",
        "tiny_title": "(needs CUDA: not run with TINY=1)",
        "measures": [
            ("fps", "frames/s, back to back through frames()", "higher", 0.03),
            ("p50_ms", "p50 ms, one frame waited for at a time", "lower", None),
            ("p99_ms", "p99 ms", "lower", None),
        ],
    },
    "deepcache": {
        "title": "SD1.5 architecture, fused fp16, 512², 50 DDIM steps, CFG, DeepCache 3:0 (step-cache export): ours",
        "tiny_title": "(needs CUDA: not run with TINY=1)",
        "measures": [
            ("per_step_ms", "ms/step: ({steps}-step − {short}-step median) / {between}", "lower", 0.02),
            ("gpu_step_ms", "GPU ms/step inside calls (CUDA events)", "lower", None),
            ("end_to_end_ms", "end to end ms, {steps} steps", "lower", 0.02),
            ("own_floor_ms", "UNet graph replayed alone, ms (the card's drift)", "lower", None),
        ],
    },
}
SIDES = ("before", "after")


def bench(package_root: str, argv: List[str]) -> int:
    """The bench's command line in this process, once ``optimum_iobinding`` is known to come from ``package_root``."""
    import optimum_iobinding

    where = Path(optimum_iobinding.__file__).resolve()
    expected = (Path(package_root) / "optimum_iobinding").resolve()
    print(f"optimum_iobinding: {where}", flush=True)
    if expected not in where.parents:
        print(f"ab_compare: expected optimum_iobinding from {expected}, got {where}", file=sys.stderr)
        return 3
    from optimum_iobinding.bench.cli import main

    return main(argv)


def read_round(path: Path) -> Dict[str, Any]:
    """One process's result, or ``{"error": ...}`` where it is missing, failed or was skipped."""
    if not path.is_file():
        return {"error": f"no {path.name} (see {path.with_suffix('.log').name})"}
    result = json.loads(path.read_text())
    if "error" in result or "skipped" in result:
        return {"error": str(result.get("error") or result.get("skipped"))[-300:]}
    return result


def mean(values: List[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def spread(values: List[float]) -> Optional[float]:
    """(largest − smallest) / mean of the rounds of one side: how far the same code lay apart."""
    return (max(values) - min(values)) / mean(values) if len(values) > 1 and mean(values) else None


def slowdown(before: float, after: float, better: str) -> float:
    """How much slower after is than before, as a fraction (negative: faster)."""
    return after / before - 1 if better == "lower" else before / after - 1


def verdict(change: Optional[float], tolerance: Optional[float]) -> str:
    if change is None or tolerance is None:
        return ""
    if abs(change) <= tolerance:
        return f"within ±{tolerance:.0%}"
    return f"**SLOWER** by {change:.1%}" if change > 0 else f"faster by {-change:.1%}"


def step_label(label: str, result: Optional[Dict[str, Any]]) -> str:
    """``label`` with the step counts of a result filled in (the single scenario's short count is 2)."""
    if result is None:
        return label.replace(": ({steps}-step − {short}-step median) / {between}", "").replace(", {steps} steps", "")
    steps, short = result["steps"], result.get("short_steps", 2)
    return label.format(steps=steps, short=short, between=steps - short)


def fmt(value: Optional[float], digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def summary(out: Path, tiny: bool) -> int:
    """Writes OUT/summary.md and OUT/summary.json; returns 1 where a measure with a tolerance is out of it, failed
    or is missing, else 0."""
    rows: List[Dict[str, Any]] = []
    failed = False
    lines = [
        "# Before / after",
        "",
        "after / before of the mean of the rounds; 'slower' is after's slowdown (frames/s: before / after − 1); "
        "'rounds apart': (largest − smallest) / mean of the same code's rounds, before / after. Round order: "
        "before, after, before, after, … on the same exports in one run.",
        "",
    ]
    meta = out / "versions.txt"
    if meta.is_file():
        lines += ["```", meta.read_text().strip(), "```", ""]
    header = [
        "| measure | before | after | after / before | slower | verdict | rounds apart | before rounds | "
        "after rounds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for step, about in STEPS.items():
        rounds = {
            side: sorted(out.glob(f"{step}-{side}-*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
            for side in SIDES
        }
        if not any(rounds.values()) and not (out / f"{step}-before-1.log").is_file():
            continue  # not selected, or not run (TINY=1)
        results = {side: [read_round(path) for path in rounds[side]] for side in SIDES}
        errors = [
            f"{side} {i + 1}: {r['error']}" for side in SIDES for i, r in enumerate(results[side]) if "error" in r
        ]
        missing = [f"{side}: no rounds (see {step}-{side}-1.log)" for side in SIDES if not rounds[side]]
        title = about["tiny_title"] if tiny else about["title"]
        lines += [f"## {step}: {title}", ""] + header
        for key, label, better, tolerance in about["measures"]:
            values = {side: [r[key] for r in results[side] if r.get(key) is not None] for side in SIDES}
            before, after = mean(values["before"]), mean(values["after"])
            change = slowdown(before, after, better) if before and after else None
            if tolerance is not None and (change is None or change > tolerance or errors or missing):
                failed = True
            label = step_label(label, next((r for side in SIDES for r in results[side] if "steps" in r), None))
            row = {
                "step": step,
                "title": title,
                "measure": key,
                "label": label,
                "better": better,
                "tolerance": tolerance,
                "before": before,
                "after": after,
                "ratio": after / before if before and after else None,
                "slowdown": change,
                "before_rounds": values["before"],
                "after_rounds": values["after"],
                "before_spread": spread(values["before"]),
                "after_spread": spread(values["after"]),
                "errors": errors + missing,
            }
            rows.append(row)
            apart = " / ".join("—" if s is None else f"{s:.1%}" for s in (row["before_spread"], row["after_spread"]))
            lines.append(
                f"| {label} | {fmt(before)} | {fmt(after)} | {fmt(row['ratio'], 4)} | "
                f"{'—' if change is None else f'{change:+.1%}'} | {verdict(change, tolerance)} | {apart} | "
                f"{', '.join(fmt(v) for v in values['before'])} | {', '.join(fmt(v) for v in values['after'])} |"
            )
        lines.append("")
        for error in errors + missing:
            lines.append(f"- failed: {' '.join(error.split())}")
        lines += [""] if errors or missing else []
    lines += [
        "A verdict within the tolerance is meaningful only where the same code's rounds lay closer together "
        "than the tolerance ('rounds apart').",
        "",
    ]
    if tiny:
        lines.insert(2, "TINY=1: the CPU check of the script on tiny models: no timing here means anything.\n")
    (out / "summary.md").write_text("\n".join(lines))
    (out / "summary.json").write_text(json.dumps({"tiny": tiny, "rows": rows}, indent=2))
    print("\n".join(lines))
    return 1 if failed else 0


def main(argv: List[str]) -> int:
    if len(argv) >= 2 and argv[0] == "bench":
        return bench(argv[1], argv[2:])
    if len(argv) in (2, 3) and argv[0] == "summary" and argv[2:] in ([], ["--tiny"]):
        return summary(Path(argv[1]), tiny=argv[2:] == ["--tiny"])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
