"""The benchmark's parts that run without a GPU (the GPU runs themselves happen on the GPU machine): the recipes and
the export cache, the reports (rows, ratios, skipped peers), the orchestration's order, the command line, the memory
sampler and the cold-start timeline."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from optimum_iobinding.bench.report import write_report
from optimum_iobinding.bench.zoo import recipe_of


def peer(ms, per_step, memory=1000.0):
    return {
        "end_to_end_ms": ms,
        "per_step_ms": per_step,
        "peak_memory_mib": memory,
        "htod_bytes_per_step": 2,
        "dtoh_bytes_per_step": 0,
        "max_abs_diff_vs_numpy": 1e-3,
    }


def test_the_report_compares_with_numpy_or_with_optimum_where_diffusers_has_no_numpy_pipeline(tmp_path):
    results = {
        "environment": {"device": "GPU", "command": "optimum-iobinding bench"},
        "steps": 30,
        "runs": 3,
        "warmup": 1,
        "rows": [
            {
                "model": "sd15",
                "size": 512,
                "dtype": "fp16",
                "export": "plain",
                "reference": "numpy",
                "floor": {"per_step_ms": 10.0},
                "peers": {"numpy": peer(600.0, 20.0), "graph": peer(300.0, 10.1)},
            },
            {
                "model": "sdxl",
                "size": 1024,
                "dtype": "fp16",
                "export": "optimized",
                "reference": "optimum",
                "floor": {"per_step_ms": 20.0},
                "peers": {
                    "numpy": {"peer": "numpy", "skipped": "diffusers has no ONNX (numpy) pipeline for sdxl"},
                    "optimum": peer(1000.0, 30.0),
                    "graph": peer(500.0, 20.0),
                    "binding": {"error": "Traceback\nRuntimeError: boom"},
                },
            },
        ],
    }
    write_report(results, tmp_path)
    table = (tmp_path / "results.md").read_text()
    assert "| sd15 512² | fp16 | plain | graph | 300.0 | 10.10 | 2.00 | 1.010 |" in table
    assert "| sdxl 1024² | fp16 | optimized | graph | 500.0 | 20.00 | 2.00 | 1.000 |" in table
    assert "| sdxl 1024² | fp16 | optimized | numpy | — (diffusers has no ONNX (numpy) pipeline for sdxl)" in table
    assert "| sdxl 1024² | fp16 | optimized | binding | failed: RuntimeError: boom" in table


def test_few_step_recipes_fix_their_steps_and_guidance():
    assert recipe_of("lcm")["steps"] == 4 and recipe_of("lcm")["scheduler"] == "lcm"
    assert recipe_of("turbo")["guidance"] == 0.0 and recipe_of("turbo")["short_steps"] == 1
    assert recipe_of("sd15") == recipe_of("small") and recipe_of("sd15")["steps"] is None


def test_an_export_is_made_once_and_a_failed_one_leaves_no_folder_that_looks_whole(tmp_path, monkeypatch):
    import optimum_iobinding.bench.zoo as zoo
    import optimum_iobinding.export as export
    from optimum_iobinding.layout import building_beside

    calls = []

    def fake_export(model, output_dir, **kwargs):  # as export_pipeline writes: beside, renamed when whole
        calls.append(Path(output_dir))
        with building_beside(Path(output_dir)) as scratch:
            (scratch / "unet").mkdir()
            if len(calls) == 1:
                raise RuntimeError("export died half way")
            (scratch / "model_index.json").write_text("{}")

    monkeypatch.setattr(export, "export_pipeline", fake_export)
    monkeypatch.setattr(zoo, "build_torch_pipeline", lambda kind: None)
    with pytest.raises(RuntimeError, match="half way"):
        zoo.ensure_export("tiny", "fp16", "plain", tmp_path)
    assert not (tmp_path / "tiny-fp16-plain").exists()
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]  # nothing half-built left behind
    folder = zoo.ensure_export("tiny", "fp16", "plain", tmp_path)
    assert folder == tmp_path / "tiny-fp16-plain" and (folder / "model_index.json").is_file()
    assert zoo.ensure_export("tiny", "fp16", "plain", tmp_path) == folder
    assert len(calls) == 2


def test_the_ddim_recipe_turns_clip_sample_off_whatever_the_scheduler_config_says():
    # a PNDM config has no clip_sample: DDIM's own default would clip, while diffusers' ONNX pipeline turns clipping off
    # when it loads such a config — the peers would run different loops and differ by up to 1.0 on the tiny model
    from types import SimpleNamespace

    from diffusers import PNDMScheduler

    from optimum_iobinding.bench.zoo import set_recipe_scheduler

    pipe = SimpleNamespace(scheduler=PNDMScheduler(skip_prk_steps=True, steps_offset=1))
    set_recipe_scheduler(pipe, "tiny")
    assert type(pipe.scheduler).__name__ == "DDIMScheduler" and pipe.scheduler.config.clip_sample is False


def test_the_export_cache_never_deletes_a_folder_it_did_not_make(tmp_path, monkeypatch):
    import optimum_iobinding.bench.zoo as zoo

    mine = tmp_path / "tiny-fp16-plain"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    monkeypatch.setattr(zoo, "build_torch_pipeline", lambda kind: None)
    with pytest.raises(FileExistsError, match="not a finished export"):
        zoo.ensure_export("tiny", "fp16", "plain", tmp_path)
    assert (mine / "notes.txt").read_text() == "mine"


def test_the_mixed_report_gives_the_worst_later_round_and_sessions_created(tmp_path):
    from optimum_iobinding.bench.report import mixed_summary, write_mixed_report

    result = {
        "peer": "defaults",
        "batches": [1, 4],
        "per_round_ms": [{"1": 900.0, "4": 2000.0}, {"1": 100.0, "4": 300.0}, {"1": 104.0, "4": 330.0}],
        "sessions_after_round": [6, 6, 7],
        "peak_memory_mib": 2000.0,
        "load_s": 3.0,
        "warmup_s": None,
        "first_image_s": 1.5,
    }
    summary = mixed_summary(result)
    assert summary["best_ms"] == {"1": 100.0, "4": 300.0}
    assert summary["worst_later_round_ratio"] == {"1": 1.04, "4": 1.1}
    assert summary["sessions_created_after_round_1"] == 1  # a rebuild after warm-up shows
    results = {
        "environment": {"device": "GPU", "command": "bench", "date": "today"},
        "batches": [1, 4],
        "steps": 10,
        "rounds": 3,
        "first_steps": 30,
        "rows": [
            {
                "model": "tiny",
                "dtype": "fp16",
                "export": "plain",
                "size": 512,
                "peers": {
                    "numpy": dict(result, peer="numpy", peak_memory_mib=1000.0, sessions_after_round=[None] * 3),
                    "defaults": result,
                    "graph": {"error": "Traceback\nRuntimeError: boom"},
                },
            }
        ],
    }
    write_mixed_report(results, tmp_path)
    table = (tmp_path / "mixed.md").read_text()
    assert "| 900 / 2000 | 100 / 300 | 104 / 330 | 1.100 | 2000 | 2.00 | 1 | 3.0 |  | 1.50 |" in table
    assert "failed: RuntimeError: boom" in table
    assert "3 rounds, one call per batch size each" in table and "load (imports included)" in table
    results["cycles"] = 3
    results["rows"][0]["peers"]["defaults"] = dict(result, import_s=12.0)
    write_mixed_report(results, tmp_path)
    table = (tmp_path / "mixed.md").read_text()
    assert "3 rounds of 3 passes over them (a round's ms: the median of its 3 calls" in table
    assert "load (imports apart)" in table


def test_repeated_processes_combine_into_their_median_and_keep_every_run():
    from optimum_iobinding.bench.report import combine_repeats

    first = {
        **peer(100.0, 3.0, memory=900.0),
        "end_to_end_ms_all": [100.0, 101.0],
        "load_s": 10.0,
        "first_image_s": 2.0,
        "image": "a.npy",
    }
    second = {
        **peer(80.0, 2.5, memory=950.0),
        "end_to_end_ms_all": [80.0, 79.0],
        "load_s": 12.0,
        "first_image_s": 2.4,
        "image": "a.npy",
    }
    third = {
        **peer(90.0, 2.8, memory=940.0),
        "end_to_end_ms_all": [90.0],
        "load_s": 11.0,
        "first_image_s": 2.2,
        "image": "a.npy",
    }
    combined = combine_repeats([first, second, third])
    assert combined["end_to_end_ms"] == 90.0 and combined["per_step_ms"] == 2.8
    assert combined["load_s"] == 11.0 and combined["first_image_s"] == 2.2
    assert combined["peak_memory_mib"] == 950.0
    assert combined["end_to_end_ms_all"] == [100.0, 101.0, 80.0, 79.0, 90.0]
    assert [r["end_to_end_ms"] for r in combined["repeats"]] == [100.0, 80.0, 90.0]
    assert combine_repeats([first]) is first
    assert combined["per_step_over_own_floor"] is None  # no process measured its own graph (numpy, binding)
    failed = combine_repeats([first, {"error": "Traceback\nRuntimeError: boom"}])
    assert failed["error"].endswith("boom") and len(failed["repeats"]) == 2


def test_repeats_rotate_the_peer_order_so_no_peer_always_follows_the_same_one(tmp_path, monkeypatch):
    import optimum_iobinding.bench.cli as cli

    order = []

    def fake_subprocess(args, pythonpath, timeout):
        if "--run-floor" in args:
            return {"per_step_ms": 1.0}
        name = args[args.index("--run-peer") + 1]
        order.append(name)
        ms = {"numpy": 300.0, "defaults": 100.0, "graph": 90.0}[name] + len(order)
        return {**peer(ms, ms / 30), "end_to_end_ms_all": [ms], "load_s": 1.0, "first_image_s": 1.0}

    monkeypatch.setattr(cli, "run_in_subprocess", fake_subprocess)
    monkeypatch.setattr(cli, "ensure_export", lambda kind, dtype, export, work, step_cache: tmp_path / "export")
    monkeypatch.setattr(cli, "environment", lambda: {"device": "GPU", "command": "bench"})
    results = cli.benchmark(
        ["small"],
        ["fp16"],
        ["optimized"],
        ["numpy", "defaults", "graph"],
        30,
        3,
        1,
        tmp_path,
        tmp_path / "out",
        None,
        60,
        repeats=3,
    )
    assert order == ["numpy", "defaults", "graph", "defaults", "graph", "numpy", "graph", "numpy", "defaults"]
    defaults = results["rows"][0]["peers"]["defaults"]
    assert defaults["end_to_end_ms_all"] == [102.0, 104.0, 109.0] and defaults["end_to_end_ms"] == 104.0
    assert "median over the processes" in (tmp_path / "out" / "results.md").read_text()
    with pytest.raises(ValueError, match="repeats: expected at least 1, got 0"):
        cli.benchmark(
            ["small"], ["fp16"], ["optimized"], ["numpy"], 30, 3, 1, tmp_path, tmp_path / "out2", None, 60, repeats=0
        )


def test_the_cli_refuses_fewer_than_one_repeat_before_looking_for_a_gpu(capsys):
    from optimum_iobinding.bench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--repeats", "0"])
    assert exit_info.value.code == 2
    assert "--repeats: expected an integer ≥ 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--work", "--out"])
def test_the_cli_refuses_a_work_or_out_that_is_a_file_before_any_work(tmp_path, capsys, option):
    from optimum_iobinding.bench.cli import main

    (tmp_path / "afile.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        main(["--scenario", "transformer", "--device", "cpu", option, str(tmp_path / "afile.txt")])
    assert exit_info.value.code == 2
    assert (
        f"{option}: expected a folder, got '{tmp_path / 'afile.txt'}'; a file has that name" in capsys.readouterr().err
    )
    assert os.listdir(tmp_path) == ["afile.txt"] and (tmp_path / "afile.txt").read_text() == "mine"


def test_report_only_refuses_a_folder_without_results_and_names_what_it_rendered(tmp_path, capsys):
    from optimum_iobinding.bench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--report-only", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--out: expected a folder holding an earlier run's results (results.json," in err
    assert f"got '{tmp_path}', which holds none" in err
    (tmp_path / "coldstart.json").write_text(json.dumps({"environment": {}, "scenario": "coldstart", "rows": []}))
    assert main(["--report-only", "--out", str(tmp_path)]) == 0
    assert f"{tmp_path / 'coldstart.json'} → coldstart.md" in capsys.readouterr().out
    assert (tmp_path / "coldstart.md").is_file()


def test_a_mixed_round_goes_through_the_batch_sizes_in_turn_and_keeps_every_call():
    from optimum_iobinding.bench.peers import mixed_rounds

    order, sessions = [], iter([5, 5, 6])

    def call(batch):
        order.append(batch)
        return float(10 * batch + len(order))

    per_round, created = mixed_rounds(call, [1, 4, 8, 2], rounds=3, cycles=2, created=lambda: next(sessions))
    assert order == [1, 4, 8, 2] * 6  # the size changes on every call, as a service's would
    assert created == [5, 5, 6]
    assert per_round[0] == {"1": [11.0, 15.0], "4": [42.0, 46.0], "8": [83.0, 87.0], "2": [24.0, 28.0]}
    assert [len(calls["8"]) for calls in per_round] == [2, 2, 2]


def test_the_bench_cli_refuses_fewer_than_one_cycle(capsys):
    from optimum_iobinding.bench.cli import main

    with pytest.raises(SystemExit):
        main(["--scenario", "mixed", "--cycles", "0"])
    assert "--cycles: expected an integer ≥ 1, got 0" in capsys.readouterr().err


def test_a_peers_imports_are_timed_apart_from_its_load():
    import sys

    from optimum_iobinding.bench.peers import import_peer

    seconds = import_peer("defaults")
    assert seconds >= 0.0 and "optimum_iobinding.pipelines" in sys.modules
    assert import_peer("numpy") >= 0.0 and hasattr(sys.modules["diffusers"], "OnnxStableDiffusionPipeline")


def test_the_cold_start_timeline_names_the_runtimes_set_up_and_first_runs_by_component(tmp_path):
    # benchmarks/cold_start.py's timeline variant on the CPU with the tiny pipeline: its rows come from the runtime's
    # opt-in timeline, each model named by its component folder
    import importlib.util

    import torch

    from optimum_iobinding import OnnxStableDiffusionPipeline
    from optimum_iobinding.export import export_pipeline

    folder = export_pipeline(None, tmp_path / "sd", tiny_random=True, progress=False)
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "cold_start.py"
    spec = importlib.util.spec_from_file_location("cold_start", script)
    cold_start = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cold_start)
    start, finish = cold_start.record_timeline(torch)
    start()  # from the load on (the benchmark starts the clock at the first image)
    try:
        pipe = OnnxStableDiffusionPipeline.from_pretrained(str(folder))
        pipe.set_progress_bar_config(disable=True)
        pipe("a", height=64, width=64, num_inference_steps=2, output_type="np")
    finally:
        rows = finish()  # ends the recording whatever happened
    labels = [row[2] for row in rows]
    assert "session unet" in labels and "run 1 unet (host)" in labels and "run 1 vae_decoder (host)" in labels
    assert "run 4 unet (host)" not in labels  # each model's first three runs only
    assert all(begin <= end for begin, end, _, _ in rows) and [row[1] for row in rows] == sorted(row[1] for row in rows)


def test_the_attention_setup_script_runs_every_shape_four_times_and_its_packed_graphs_load():
    # benchmarks/attention_setup.py on the CPU: the query, key and value apart (ORT's CPU kernel takes no packed QKV);
    # the packed graphs the GPU runs are checked by ONNX and made into sessions, whose inputs are the fused UNet's
    import importlib.util

    import onnx
    import onnxruntime as ort

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "attention_setup.py"
    spec = importlib.util.spec_from_file_location("attention_setup", script)
    attention_setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(attention_setup)
    rows = attention_setup.measure(["CPUExecutionProvider"], packed=False)
    assert [(row["kind"], row["tokens"], row["head_size"]) for row in rows] == [
        (kind, tokens, size) for tokens, size in attention_setup.SHAPES for kind in ("self", "cross")
    ]
    assert all(row[key] > 0 for row in rows for key in ("first_s", "again_s", "thread_s", "session_s"))
    self_model = attention_setup.attention_model("self", 1024, 80)
    cross_model = attention_setup.attention_model("cross", 1024, 80)
    for model in (self_model, cross_model):
        onnx.checker.check_model(onnx.load_from_string(model))
    shapes = {
        name: [[value.name, value.shape] for value in ort.InferenceSession(model).get_inputs()]
        for name, model in (("self", self_model), ("cross", cross_model))
    }
    assert shapes == {
        "self": [["qkv", [2, 1024, 8, 3, 80]]],
        "cross": [["q", [2, 1024, 640]], ["kv", [2, 77, 8, 2, 80]]],
    }


def test_the_cold_starts_attention_prewarm_runs_every_shape_under_the_device_gate_and_waits_for_close(monkeypatch):
    # benchmarks/cold_start.py's attention-prewarm variant on the CPU: every shape of attention_setup.py runs once in
    # a thread of its own; no run starts while a session is being made (the runtime's gate), and the threads stay
    # until close()
    import importlib.util
    import sys

    import onnxruntime as ort

    from optimum_iobinding.runtime.cuda_policy import DEVICE_SETUP

    folder = Path(__file__).resolve().parents[2] / "benchmarks"
    monkeypatch.syspath_prepend(str(folder))  # the script imports attention_setup from its folder
    spec = importlib.util.spec_from_file_location("cold_start", folder / "cold_start.py")
    cold_start = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cold_start)
    prewarm = cold_start.AttentionPrewarm(ort, ["CPUExecutionProvider"], packed=False)
    with DEVICE_SETUP.build():  # a session being made elsewhere: the prewarm's runs wait for it
        prewarm.start()
        threads = list(prewarm.threads)
        assert prewarm.ran == []
    prewarm.close()
    shapes = sys.modules["attention_setup"].SHAPES
    assert sorted(prewarm.ran) == sorted((kind, t, h) for t, h in shapes for kind in ("self", "cross"))
    assert prewarm.errors == [] and len(threads) == 2 * len(shapes) and not any(t.is_alive() for t in threads)


def test_the_split_first_run_script_cuts_a_unet_into_parts_that_give_its_outputs(tiny_fused_folder, tmp_path):
    # benchmarks/split_first_run.py on the CPU with the tiny fused UNet, as stored and with its nodes stored in
    # reverse (each before the makers of its inputs, as ORT's optimizer saves casts it added): the parts, run in turn,
    # give the whole model's output, and each variant's sessions make their first runs in turn or side by side
    import importlib.util

    import onnx

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "split_first_run.py"
    spec = importlib.util.spec_from_file_location("split_first_run", script)
    split = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(split)
    stored = tiny_fused_folder / "unet" / "model.onnx"
    model = onnx.load(str(stored))
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    reversed_path = tmp_path / "reversed.onnx"
    onnx.save(model, str(reversed_path))
    dims = split.parse_dims("batch=2,height=8,width=8,sequence=77,timestep_batch=1")
    for name, source in (("stored", stored), ("reversed", reversed_path)):
        entry = split.prepare(str(source), tmp_path / name, 3, dims, "cpu")
        assert len(entry["paths"]) == 3 and len(entry["cut_nodes"]) == 2
        assert entry["crossing_tensors"][-1] == 1  # the last part makes the model's one output
        assert entry["max_abs_difference"]["out_sample"] < 1e-4
    whole = split.measure("whole", [str(stored)], dims, "cpu")
    serial = split.measure("parts-3:serial", entry["paths"], dims, "cpu")
    threads = split.measure("parts-3:threads", entry["paths"], dims, "cpu")
    assert len(whole["each_first_run_s"]) == 1
    assert len(serial["each_first_run_s"]) == len(threads["each_first_run_s"]) == 3
    assert all(
        row[key] > 0 for row in (whole, serial, threads) for key in ("sessions_s", "first_run_s", "second_run_s")
    )
    with pytest.raises(SystemExit, match="--dims: the input 'sample' has the free dimension 'height', which it lacks"):
        split.measure("whole", [str(stored)], split.parse_dims("batch=2"), "cpu")


def test_each_process_compares_its_loop_with_its_own_graph_and_the_table_shows_both_floors(tmp_path):
    """The per-step target divides each process's step by the replays of the very graph its loop ran, and the
    combined result is the median of those ratios (not a ratio of medians from different processes)."""
    from optimum_iobinding.bench.report import combine_repeats

    processes = [
        {
            **peer(90.0, step),
            "own_floor_ms": floor,
            "per_step_over_own_floor": step / floor,
            "gpu_step_ms": gpu,
            "gpu_step_over_own_floor": gpu / floor,
        }
        for step, floor, gpu in ((2.36, 2.32, 2.33), (2.27, 2.25, 2.30), (2.37, 2.31, 2.34))
    ]
    combined = combine_repeats(processes)
    assert combined["per_step_over_own_floor"] == pytest.approx(2.36 / 2.32)
    assert combined["gpu_step_over_own_floor"] == pytest.approx(2.34 / 2.31)
    assert combined["own_floor_ms"] == 2.31 and combined["gpu_step_ms"] == 2.33
    results = {
        "environment": {"device": "GPU", "command": "optimum-iobinding bench"},
        "steps": 30,
        "runs": 3,
        "warmup": 1,
        "rows": [
            {
                "model": "small",
                "size": 256,
                "dtype": "fp16",
                "export": "optimized",
                "reference": "numpy",
                "floor": {"per_step_ms": 2.27},
                "peers": {"numpy": peer(350.0, 9.0), "defaults": combined},
            }
        ],
    }
    write_report(results, tmp_path)
    table = (tmp_path / "results.md").read_text()
    assert (
        "| small 256² | fp16 | optimized | defaults | 90.0 | 2.36 | 3.89 | 1.040 | 1.017 (2.31) | 1.013 (2.330) |"
        in table
    )
    numpy_row = next(line for line in table.splitlines() if "| numpy |" in line)
    assert numpy_row.split("|")[9].strip() == numpy_row.split("|")[10].strip() == ""  # no graph, no own floor
    header = table.splitlines()[4]
    assert all(line.count("|") == header.count("|") for line in table.splitlines()[4:] if line.startswith("|"))


def test_a_pipeline_without_a_captured_unet_graph_has_no_own_floor():
    from types import SimpleNamespace

    from optimum_iobinding.bench.probes import own_graph_floor

    assert own_graph_floor(SimpleNamespace()) is None
    assert own_graph_floor(SimpleNamespace(unet=SimpleNamespace(graph_signatures=[]))) is None
    two = [{"sample": (2, 4, 32, 32)}, {"sample": (8, 4, 32, 32)}]
    assert own_graph_floor(SimpleNamespace(unet=SimpleNamespace(graph_signatures=two))) is None


def test_the_memory_sampler_names_its_source_and_refuses_an_unknown_one():
    import torch

    from optimum_iobinding.bench.probes import PeakMemory

    with pytest.raises(ValueError, match="source: expected 'auto', 'process', 'nvml' or 'cudart', got 'smi'"):
        PeakMemory(torch.device("cuda", 0), source="smi")
    assert PeakMemory(torch.device("cuda", 0), source="cudart").source == "cudart"


def test_the_sampling_process_reports_the_peak_it_saw_between_enter_and_exit(tmp_path, monkeypatch):
    """The sampler of ``source="process"`` is a child process polling NVML (here a stand-in pynvml whose used
    memory is 100 at its start, 700 at its next read, whether that comes in its loop or at the stop, and 150 after),
    so that the measured process runs no sampling thread; it runs at the lowest CPU priority (the stand-in writes
    its niceness down), yielding the CPUs to the measured process's threads."""
    import torch

    from optimum_iobinding.bench import probes

    (tmp_path / "pynvml.py").write_text(
        "import itertools\n"
        "from types import SimpleNamespace\n"
        "reads = itertools.chain([100, 700], itertools.repeat(150))\n"
        "import os\n"
        f"def nvmlInit(): open({str(tmp_path / 'niceness')!r}, 'w').write(str(os.nice(0)))\n"
        "def nvmlDeviceGetHandleByPciBusId(bus):\n"
        "    assert bus == '00000000:17:00.0', bus\n"
        "    return 'handle'\n"
        "def nvmlDeviceGetMemoryInfo(handle): return SimpleNamespace(used=next(reads))\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(probes, "nvml_reader", lambda device: lambda: 120)
    monkeypatch.setattr(probes, "pci_bus_id", lambda device: "00000000:17:00.0")
    sampler = probes.PeakMemory(torch.device("cuda", 0))
    assert sampler.source == "process" and sampler.exit_code is None
    with sampler:
        pass
    assert sampler.peak == 700 and sampler.exit_code == 0
    assert (tmp_path / "niceness").read_text() == "19"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--models", "sd15,sdx"],
            "--models: expected a comma-separated list of tiny, small, sd15, sdxl, lcm, turbo, got 'sd15,sdx'",
        ),
        (
            ["--dtypes", "bf16"],
            "--dtypes: expected a comma-separated list of fp16, fp32 (bf16 only with --scenario "
            "transformer or video: the diffusion transformers), got 'bf16'",
        ),
        (
            ["--scenario", "stream", "--dtypes", "bf16"],
            "--dtypes: expected a comma-separated list of fp16, fp32 (bf16 only with --scenario transformer",
        ),
        (["--peers", ""], "--peers: expected a comma-separated list of"),
        (["--steps", "0"], "--steps: expected an integer ≥ 1, got 0"),
        (["--warmup", "-1"], "--warmup: expected an integer ≥ 0, got -1"),
        (
            ["--mixed-batches", "1,x"],
            "--mixed-batches: expected a comma-separated list of positive integers, got '1,x'",
        ),
        (["--tiny"], "--tiny: expected only with --scenario video, got '--scenario single'"),
        (
            ["--scenario", "video", "--steps", "1"],
            "--steps: expected an integer ≥ 2 with --scenario video (a step is timed between two step ends), got 1",
        ),
        (["--scenario", "video", "--models", "sd15"], "--models: expected none with --scenario video"),
        (
            ["--scenario", "video", "--tiny", "--peers", "ours,compile"],
            "--peers: expected peers that run on the CPU (ours, torch) with --device cpu, got 'ours,compile'; "
            "compile measures CUDA work",
        ),
        (
            ["--scenario", "video", "--mlperf-peers", "ours,floor"],
            "--mlperf-peers: expected a comma-separated list of ours, torch, compile, or none, got 'ours,floor'",
        ),
        (
            ["--scenario", "coldstart", "--models", "sdxl"],
            "--models: expected a comma-separated list of sd15, flux-schnell, got 'sdxl'",
        ),
        (["--vae-dtype", "fp16"], "--vae-dtype: expected only with --scenario video, got '--scenario single'"),
    ],
)
def test_the_bench_cli_names_every_bad_option_before_any_work(argv, message, capsys):
    from optimum_iobinding.bench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_bench_cli_takes_no_abbreviations(capsys):
    from optimum_iobinding.bench.cli import main

    with pytest.raises(SystemExit):
        main(["--step", "2"])  # not taken for --steps
    assert "unrecognized arguments: --step 2" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- the stream scenario
def stream_result(p50, p99, fps):
    return {"p50_ms": p50, "p99_ms": p99, "fps": fps, "latency_ms_all": [p50, p99]}


def stream_results():
    from optimum_iobinding.bench.cli import stream_rows

    rows = stream_rows()
    for row in rows:
        tiny = row["vae"] == "tiny"
        row["peers"] = {
            "ours": stream_result(10.0 if tiny else 30.0, 12.0, 110.0),
            "numpy": (
                {"peer": "numpy", "skipped": "diffusers' ONNX img2img pipeline runs the folder's own VAE"}
                if tiny
                else stream_result(90.0, 95.0, 11.0)
            ),
            "torch": stream_result(40.0 if tiny else 60.0, 45.0, 25.0),
            "floor": {
                "peer": "floor",
                "frame_ms": 8.0,
                "fps": 125.0,
                "unet_batch": 1,
                "unet_calls": 1,
                "parts_ms": {"vae_encoder": 2.0, "unet": 5.0, "vae_decoder": 1.0},
            },
        }
        if row["unet_steps"] == 1:
            row["peers"]["video"] = {
                "peer": "video",
                "frames": 120,
                "codec_fps": 300.0,
                "command_fps": 80.0,
                "in_memory_host_fps": 95.0,
            }
    rows[-1]["peers"]["ours"] = {"peer": "ours", "error": "Traceback …\nRuntimeError: the graph broke"}
    return stream_report_input(rows)


def stream_report_input(rows):
    """The stream scenario's results around ``rows``, as the bench writes them for its report."""
    return {
        "environment": {"device": "GPU", "command": "optimum-iobinding bench --scenario stream", "date": "today"},
        "scenario": "stream",
        "model": "turbo",
        "size": 512,
        "dtype": "fp16",
        "export": "optimized",
        "frames": 200,
        "video_frames": 120,
        "warmup": 10,
        "rows": rows,
    }


def test_the_stream_report_gives_latency_frames_per_second_and_ratios_to_the_floor_and_torch_tiny(tmp_path):
    from optimum_iobinding.bench.report import write_stream_report

    write_stream_report(stream_results(), tmp_path)
    table = (tmp_path / "stream.md").read_text()
    # ours with the tiny VAE: 10 ms against a floor of 8 (1.25) and torch tiny-VAE's 40 ms (4.00 × faster)
    assert "| 1 step, tiny VAE | ours | 10.00 | 12.00 | 110.0 | 1.25 | 4.00 |" in table
    # with the full VAE: 30 / 8 and 40 / 30 (torch tiny-VAE of the same step count)
    assert "| 1 step, full VAE | ours | 30.00 | 12.00 | 110.0 | 3.75 | 1.33 |" in table
    assert "| 2 steps, stream batch, full VAE | numpy | 90.00 | 95.00 | 11.0 | 11.25 | 0.44 |" in table
    assert "| 1 step, tiny VAE | numpy | — (diffusers' ONNX img2img pipeline runs the folder's own VAE) |" in table
    assert "| 2 steps in turn, tiny VAE | ours | failed: RuntimeError: the graph broke |" in table
    assert "floor (encoder 2.00 + UNet 1 × 5.00 at batch 1 + decoder 1.00) | 8.00 |" in table
    # the video: codec alone, the command, from memory with host frames, ours with CUDA frames
    assert "| 1 step, tiny VAE | 120 | 300.0 | 80.0 | 95.0 | 110.0 |" in table
    assert "`optimum-iobinding bench --scenario stream`" in table


def test_a_failing_stream_peer_records_its_error_and_the_others_go_on(tmp_path, monkeypatch):
    import optimum_iobinding.bench.cli as cli

    calls = []

    def fake_run(args, pythonpath, timeout):
        peer = args[args.index("--run-stream") + 1]
        calls.append((peer, args))
        if peer == "numpy":
            return {"error": "Traceback …\nValueError: no such pipeline"}
        if peer == "video":
            return {"peer": "video", "frames": 30, "codec_fps": 300.0, "command_fps": 80.0, "in_memory_host_fps": 90.0}
        return stream_result(10.0, 11.0, 100.0)

    monkeypatch.setattr(cli, "ensure_export", lambda kind, dtype, export, work: tmp_path / f"{kind}-{dtype}-{export}")
    monkeypatch.setattr(cli, "ensure_tiny_vae_export", lambda dtype, export, work: tmp_path / "taesd")
    monkeypatch.setattr(cli, "environment", lambda: {"device": "GPU", "command": "bench", "date": "today"})
    results = cli.stream_benchmark(
        ["ours", "numpy", "torch", "video"],
        "fp16",
        "optimized",
        50,
        30,
        5,
        tmp_path,
        tmp_path / "out",
        60,
        run=fake_run,
    )
    assert [(row["unet_steps"], row["stream_batch"], row["vae"]) for row in results["rows"]] == [
        (1, True, "full"),
        (1, True, "tiny"),
        (2, True, "full"),
        (2, True, "tiny"),
        (2, False, "full"),
        (2, False, "tiny"),
    ]
    for row in results["rows"]:
        assert "error" in row["peers"]["numpy"] and row["peers"]["ours"]["fps"] == 100.0
        assert ("video" in row["peers"]) == (row["unet_steps"] == 1)
    # numpy and torch run once per step count and VAE: the row without the stream batch reuses them
    assert [peer for peer, _ in calls].count("torch") == 4 and [peer for peer, _ in calls].count("ours") == 6
    assert results["rows"][4]["peers"]["torch"]["measured_in"] == "2 steps, stream batch, full VAE"
    tiny_args = [args for peer, args in calls if peer == "ours"][1]
    assert tiny_args[tiny_args.index("--tiny-vae-folder") + 1] == str(tmp_path / "taesd")
    assert (tmp_path / "out" / "stream.md").is_file() and (tmp_path / "out" / "stream.json").is_file()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--frames", "0"], "--frames: expected an integer ≥ 1, got 0"),
        (["--video-frames", "0"], "--video-frames: expected an integer ≥ 1, got 0"),
        (["--frame-warmup", "-1"], "--frame-warmup: expected an integer ≥ 0, got -1"),
        (
            ["--peers", "ours,graph"],
            "--peers: expected for --scenario stream a comma-separated list of ours, numpy, "
            "torch, floor, video, got 'ours,graph'",
        ),
    ],
)
def test_the_stream_scenario_checks_its_options_before_looking_for_a_gpu(capsys, argv, message):
    from optimum_iobinding.bench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--scenario", "stream", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_stream_scenario_uses_the_fused_fp16_export_unless_told_otherwise():
    import argparse

    from optimum_iobinding.bench.cli import stream_export

    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="fp16,fp32")
    parser.add_argument("--exports", default="plain,optimized")
    split = lambda text: text.split(",")  # noqa: E731
    assert stream_export(parser, parser.parse_args([]), split) == ("fp16", "optimized")
    assert stream_export(parser, parser.parse_args(["--exports", "plain"]), split) == ("fp16", "plain")


@pytest.mark.parametrize("steps, strength, unet_steps", [(2, 0.5, 1), (4, 0.5, 2), (1, 1.0, 1), (3, 0.5, 1)])
def test_the_stream_takes_the_last_strength_of_the_steps_as_diffusers_img2img_does(steps, strength, unet_steps):
    from diffusers import EulerAncestralDiscreteScheduler, StableDiffusionImg2ImgPipeline

    from optimum_iobinding.bench.peers import stream_unet_steps

    scheduler = EulerAncestralDiscreteScheduler(timestep_spacing="trailing")
    scheduler.set_timesteps(steps)
    pipe = StableDiffusionImg2ImgPipeline.__new__(StableDiffusionImg2ImgPipeline)
    pipe.scheduler = scheduler
    timesteps, count = pipe.get_timesteps(steps, strength, "cpu")
    assert stream_unet_steps(steps, strength) == count == unet_steps


# ------------------------------------------------------------------------------------ the transformer scenario
# the README's set-up check without a GPU, one run: the export is --device cpu's own (float32, the CPU's fusions)
TRANSFORMER_CPU_RUN = ["--scenario", "transformer", "--device", "cpu", "--runs", "1", "--warmup", "0"]
# fused operators that only the CUDA execution provider has kernels for
CUDA_ONLY_OPS = {"NhwcConv", "GroupNorm", "SkipGroupNorm", "BiasSplitGelu", "BiasAdd"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--scenario", "transformer", "--models", "sd35m,sd15"],
            "--models: expected a comma-separated list of sd35m, flux-schnell, flux-dev, tiny-sd3, tiny-flux, got "
            "'sd35m,sd15'",
        ),
        (
            ["--scenario", "transformer", "--peers", "ours,numpy"],
            "--peers: expected a comma-separated list of ours, optimum, torch, compile, floor, got 'ours,numpy'",
        ),
        (["--scenario", "transformer", "--blocks", "0"], "--blocks: expected an integer ≥ 1, got 0"),
        (["--scenario", "transformer", "--text-layers", "0"], "--text-layers: expected an integer ≥ 1, got 0"),
        (["--scenario", "transformer", "--compile-timeout", "0"], "--compile-timeout: expected an integer ≥ 1, got 0"),
        (["--blocks", "4"], "--blocks: expected only with --scenario transformer or video, got '--scenario single'"),
        (
            ["--scenario", "stream", "--text-layers", "2"],
            "--text-layers: expected only with --scenario transformer or video, got '--scenario stream'",
        ),
        (
            ["--device", "cpu"],
            "--device: expected cuda with --scenario single (it measures CUDA pipelines; --scenario "
            "transformer --models tiny-sd3,tiny-flux --device cpu checks a setup without a GPU), got "
            "'cpu'",
        ),
        (["--scenario", "mixed", "--device", "cpu"], "--device: expected cuda with --scenario mixed"),
        (["--scenario", "stream", "--device", "cpu"], "--device: expected cuda with --scenario stream"),
        (
            ["--scenario", "transformer", "--device", "cpu", "--dtypes", "fp16"],
            "--dtypes: expected fp32 with --device cpu (a float16 or bfloat16 export is for the GPU), got 'fp16'",
        ),
        (
            ["--scenario", "transformer", "--device", "cpu", "--dtypes", "bf16"],
            "--dtypes: expected fp32 with --device cpu (a float16 or bfloat16 export is for the GPU), got 'bf16'",
        ),
        (
            ["--scenario", "transformer", "--dtypes", "int8"],
            "--dtypes: expected a comma-separated list of fp16, fp32, bf16, got 'int8'",
        ),
    ],
)
def test_the_transformer_scenario_names_every_bad_option_before_any_work(argv, message, capsys):
    from optimum_iobinding.bench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def transformer_architecture(kind, blocks=None, text_layers=None):
    """The torch pipeline of ``kind`` built on the meta device: its configuration and sizes, no memory."""
    import torch

    from optimum_iobinding.bench.transformer_peers import weights_made_on
    from optimum_iobinding.bench.zoo import build_transformer_pipeline

    with weights_made_on(torch.device("meta"), torch.float32):
        return build_transformer_pipeline(kind, blocks, text_layers)


def parameters(module):
    return sum(parameter.numel() for parameter in module.parameters())


def test_sd35m_has_sd35_mediums_mmdit_and_text_encoders():
    pipe = transformer_architecture("sd35m")
    config = pipe.transformer.config
    assert (config.num_layers, config.num_attention_heads, config.attention_head_dim) == (24, 24, 64)
    assert (config.joint_attention_dim, config.caption_projection_dim, config.pooled_projection_dim) == (
        4096,
        1536,
        2048,
    )
    assert tuple(config.dual_attention_layers) == tuple(range(13)) and config.qk_norm == "rms_norm"
    assert config.pos_embed_max_size == 384 and config.sample_size * 8 == 1024
    assert (pipe.text_encoder.config.hidden_size, pipe.text_encoder.config.num_hidden_layers) == (768, 12)
    assert (pipe.text_encoder_2.config.hidden_size, pipe.text_encoder_2.config.num_hidden_layers) == (1280, 32)
    # CLIP-L's and CLIP-G's projections make SD3's pooled 2048; T5-XXL's encoder is 4.76 B parameters
    assert pipe.text_encoder.config.projection_dim + pipe.text_encoder_2.config.projection_dim == 2048
    assert 4.7e9 < parameters(pipe.text_encoder_3) < 4.8e9 and pipe.text_encoder_3.config.d_model == 4096


def test_flux_dev_is_flux1s_12b_transformer_with_the_guidance_embedding_and_schnell_without():
    dev, schnell = transformer_architecture("flux-dev"), transformer_architecture("flux-schnell")
    assert 11.8e9 < parameters(dev.transformer) < 12.0e9  # FLUX.1's 12 B
    assert (dev.transformer.config.num_layers, dev.transformer.config.num_single_layers) == (19, 38)
    assert tuple(dev.transformer.config.axes_dims_rope) == (16, 56, 56)
    assert dev.transformer.config.guidance_embeds and not schnell.transformer.config.guidance_embeds
    assert dev.scheduler.config.use_dynamic_shifting and not schnell.scheduler.config.use_dynamic_shifting


def test_blocks_keep_the_full_width_and_text_layers_shrink_every_text_encoder():
    flux = transformer_architecture("flux-schnell", blocks=2, text_layers=1)
    assert (flux.transformer.config.num_layers, flux.transformer.config.num_single_layers) == (2, 4)
    assert (flux.transformer.config.num_attention_heads, flux.transformer.config.attention_head_dim) == (24, 128)
    assert flux.text_encoder.config.num_hidden_layers == 1 and flux.text_encoder_2.config.num_layers == 1
    sd3 = transformer_architecture("sd35m", blocks=4, text_layers=2)
    assert sd3.transformer.config.num_layers == 4 and tuple(sd3.transformer.config.dual_attention_layers) == (
        0,
        1,
        2,
        3,
    )
    assert [
        sd3.text_encoder.config.num_hidden_layers,
        sd3.text_encoder_2.config.num_hidden_layers,
        sd3.text_encoder_3.config.num_layers,
    ] == [2, 2, 2]


def transformer_peer(ms, per_step, **extra):
    return {
        "end_to_end_ms": ms,
        "per_step_ms": per_step,
        "peak_memory_mib": 9000.0,
        "load_s": 10.0,
        "first_image_s": 20.0,
        "compile_s": None,
        "weights": "the export's",
        **extra,
    }


def test_the_transformer_report_gives_every_ratio_to_ours_and_the_floor(tmp_path):
    from optimum_iobinding.bench.report import write_transformer_report

    results = {
        "environment": {"device": "GPU", "command": "optimum-iobinding bench --scenario transformer"},
        "dtype": "fp16",
        "export": "optimized",
        "device": "cuda",
        "runs": 3,
        "warmup": 1,
        "rows": [
            {
                "model": "sd35m",
                "size": 1024,
                "blocks": None,
                "text_layers": None,
                "peers": {
                    "ours": transformer_peer(2000.0, 60.0),
                    "optimum": transformer_peer(4000.0, 110.0),
                    "torch": transformer_peer(2500.0, 80.0),
                    "compile": transformer_peer(1600.0, 50.0, compile_s=95.0),
                    "floor": {"peer": "floor", "per_step_ms": 50.0, "graph_inputs": {"hidden_states": [2]}},
                },
            },
            {
                "model": "flux-dev",
                "size": 1024,
                "blocks": [4, 8],
                "text_layers": 2,
                "peers": {
                    "ours": transformer_peer(1000.0, 30.0),
                    "compile": {"peer": "compile", "skipped": "did not compile within 900 s"},
                },
            },
        ],
    }
    write_transformer_report(results, tmp_path)
    table = (tmp_path / "transformer.md").read_text()
    assert "| sd35m 1024² | full model | ours | 2000.0 | 60.00 | 1.200 | 1.00 | 9000 |" in table
    assert "| sd35m 1024² | full model | optimum | 4000.0 | 110.00 | 2.200 | 0.50 |" in table
    assert "| sd35m 1024² | full model | compile | 1600.0 | 50.00 | 1.000 | 1.25 | 9000 | 10.0 | 20.0 | 95.0 |" in table
    assert "| sd35m 1024² | full model | GPU floor (transformer graph replays, batch 2) | | 50.00 | 1.000 |" in table
    cut = "4 of 19 double + 8 of 38 single blocks (not the full model), text encoders ≤ 2 layers"
    assert f"| flux-dev 1024² | {cut} | ours | 1000.0 |" in table
    assert f"| flux-dev 1024² | {cut} | compile | — (did not compile within 900 s) |" in table


def test_a_failing_transformer_peer_records_its_error_and_a_compile_past_its_limit_is_skipped(tmp_path, monkeypatch):
    import optimum_iobinding.bench.cli as cli

    calls = []

    def fake_run(args, pythonpath, timeout):
        peer = args[args.index("--run-transformer") + 1]
        calls.append((peer, pythonpath, timeout, args))
        if peer == "torch":
            return {"error": "Traceback …\nRuntimeError: out of memory"}
        if peer == "compile":
            return {"error": f"timed out after {timeout} s"}
        if peer == "floor":
            return {"peer": "floor", "per_step_ms": 20.0, "graph_inputs": {"hidden_states": [1]}}
        return transformer_peer(500.0, 21.0, image=None)

    monkeypatch.setattr(
        cli,
        "ensure_transformer_export",
        lambda kind, dtype, export, work, blocks, text_layers, device: tmp_path / f"{kind}-{dtype}-{export}",
    )
    monkeypatch.setattr(cli, "environment", lambda: {"device": "GPU", "command": "bench", "date": "today"})
    results = cli.transformer_benchmark(
        ["flux-schnell"],
        ["ours", "optimum", "torch", "compile", "floor"],
        "fp16",
        "optimized",
        3,
        None,
        3,
        1,
        "cuda",
        tmp_path,
        tmp_path / "out",
        "/optimum/site",
        600,
        1200,
        run=fake_run,
    )
    peers = results["rows"][0]["peers"]
    assert "out of memory" in peers["torch"]["error"] and peers["ours"]["end_to_end_ms"] == 500.0
    assert peers["compile"] == {"peer": "compile", "skipped": "did not compile within 1200 s"}
    assert [(peer, pythonpath, timeout) for peer, pythonpath, timeout, _ in calls] == [
        ("ours", None, 600),
        ("optimum", "/optimum/site", 600),
        ("torch", None, 600),
        ("compile", None, 1200),
        ("floor", None, 600),
    ]
    ours_args = calls[0][3]
    assert ours_args[ours_args.index("--blocks") + 1] == "3" and "--text-layers" not in ours_args
    assert results["rows"][0]["blocks"] == [3, 6]
    table = (tmp_path / "out" / "transformer.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| flux-schnell")]
    assert len(rows) == 5 and all("3 of 19 double + 6 of 38 single blocks (not the full model)" in row for row in rows)
    assert (tmp_path / "out" / "transformer.json").is_file()


@pytest.mark.slow
def test_the_transformer_scenario_runs_tiny_sd3_end_to_end_on_the_cpu_each_peer_in_its_own_process(tmp_path):
    import importlib.util
    import json

    from optimum_iobinding.bench.cli import main

    import onnx

    out = tmp_path / "out"
    assert (
        main(
            [
                *TRANSFORMER_CPU_RUN,
                "--models",
                "tiny-sd3",
                "--peers",
                "ours,torch,optimum",
                "--blocks",
                "1",
                "--work",
                str(tmp_path / "work"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    results = json.loads((out / "transformer.json").read_text())
    (row,) = results["rows"]
    # the export is the CPU's: float32, optimized without the CUDA-only fused operators, and ours ran it there
    assert (results["dtype"], results["export"]) == ("fp32", "optimized")
    folder = tmp_path / "work" / "tiny-sd3-fp32-optimized-cpu-blocks1x0"
    assert row["folder"] == str(folder)
    ops = {
        node.op_type
        for graph in folder.glob("*/model.onnx")
        for node in onnx.load(str(graph), load_external_data=False).graph.node
    }
    assert "MultiHeadAttention" in ops and not ops & CUDA_ONLY_OPS  # fused, for the CPU
    assert set(row["peers"]["ours"]["providers"].values()) == {"CPUExecutionProvider"}
    assert row["blocks"] == [1, 0] and results["environment"]["command"].startswith("optimum-iobinding bench")
    ours, torch_peer = row["peers"]["ours"], row["peers"]["torch"]
    assert ours["end_to_end_ms"] > 0 and ours["steps"] == 3 and ours["short_steps"] == 1
    # each image's range and share of non-finite values: a float16 overflow shows there at a glance
    image = np.load(ours["image"])
    assert ours["image_stats"] == pytest.approx(
        {
            "min": float(image.min()),
            "max": float(image.max()),
            "mean": float(image.mean()),
            "std": float(image.std()),
            "non_finite": 0.0,
        },
        rel=1e-5,
    )
    assert ours["graph_fallbacks"] == {}  # off CUDA nothing asks for a graph
    # the same fp32 weights through ONNX Runtime and through diffusers' torch pipeline: the same image
    assert torch_peer["weights"] == "the export's" and torch_peer["max_abs_diff_vs_ours"] < 1e-3
    optimum = row["peers"]["optimum"]
    if importlib.util.find_spec("optimum") is None:  # the main environment: recorded as unavailable
        assert "cannot be imported in this environment" in optimum["skipped"]
    else:  # the optimum environment: optimum-onnx's pipeline on the same folder makes the same image
        assert optimum["max_abs_diff_vs_ours"] < 1e-3
    table = (out / "transformer.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| tiny-sd3")]
    assert len(rows) == 3 and all("| 1 of 2 blocks (not the full model) |" in line for line in rows)


def test_the_transformer_scenario_runs_tiny_flux_and_ours_makes_diffusers_image(tmp_path):
    import json

    import optimum_iobinding.bench.cli as cli

    def in_this_process(args, pythonpath, timeout):  # the peer's own entry point, without a new interpreter
        result_path = tmp_path / "result.json"
        assert cli.main([*args, "--result", str(result_path)]) == 0
        return json.loads(result_path.read_text())

    results = cli.transformer_benchmark(
        ["tiny-flux"],
        ["ours", "torch", "floor"],
        "fp32",
        "plain",
        None,
        None,
        1,
        0,
        "cpu",
        tmp_path / "work",
        tmp_path / "out",
        None,
        600,
        600,
        run=in_this_process,
    )
    peers = results["rows"][0]["peers"]
    assert peers["torch"]["max_abs_diff_vs_ours"] < 1e-3 and peers["ours"]["image"].endswith("-ours.npy")
    assert peers["floor"]["skipped"] == "floor measures CUDA-graph replays: it needs --device cuda"
    assert "| tiny-flux 64² | full model | ours |" in (tmp_path / "out" / "transformer.md").read_text()


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU and onnxruntime-gpu")
def test_on_the_gpu_every_transformer_peer_measures_tiny_sd3_against_the_floor_of_its_cfg_graph(tmp_path):
    import json

    from optimum_iobinding.bench.cli import main

    out = tmp_path / "out"
    assert (
        main(
            [
                "--scenario",
                "transformer",
                "--models",
                "tiny-sd3",
                "--peers",
                "ours,torch,compile,floor",
                "--runs",
                "2",
                "--warmup",
                "1",
                "--work",
                str(tmp_path / "work"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    (row,) = json.loads((out / "transformer.json").read_text())["rows"]
    peers = row["peers"]
    assert peers["floor"]["per_step_ms"] > 0 and peers["floor"]["graph_inputs"]["hidden_states"][0] == 2  # CFG
    ours = peers["ours"]
    assert ours["own_floor_ms"] > 0 and ours["peak_memory_mib"] > 0 and ours["memory_source"]
    # the torch peers draw their weights on the device: measured, but not compared with ours' image
    assert "drawn on the device" in peers["torch"]["weights"] and "max_abs_diff_vs_ours" not in peers["torch"]
    assert peers["compile"].get("compile_s") is not None or "did not compile" in peers["compile"].get("skipped", "")
    assert "| tiny-sd3 64² | full model | ours |" in (out / "transformer.md").read_text()


def recorded_transformer_exports(monkeypatch) -> list:
    """The keyword arguments of every ``export_pipeline`` call the bench's transformer exports make, each export
    faked as a folder with a model_index.json (no transformer is built)."""
    import optimum_iobinding.bench.zoo as zoo
    import optimum_iobinding.export as export

    calls = []

    def fake_export(model, output_dir, **kwargs):
        calls.append(kwargs)
        Path(output_dir).mkdir(parents=True)
        (Path(output_dir) / "model_index.json").write_text("{}")

    monkeypatch.setattr(export, "export_pipeline", fake_export)
    monkeypatch.setattr(zoo, "build_transformer_pipeline", lambda kind, blocks, text_layers: None)
    return calls


@pytest.mark.parametrize("device, optimize", [("cpu", "cpu"), ("cuda", "cuda")])
def test_an_optimized_transformer_export_gets_the_fusions_of_the_device_it_runs_on(
    tmp_path, monkeypatch, device, optimize
):
    import optimum_iobinding.bench.zoo as zoo

    calls = recorded_transformer_exports(monkeypatch)
    folder = zoo.ensure_transformer_export("tiny-flux", "fp32", "optimized", tmp_path, device=device)
    assert folder.name == ("tiny-flux-fp32-optimized-cpu" if device == "cpu" else "tiny-flux-fp32-optimized")
    assert [(call["optimize"], call["dtype"]) for call in calls] == [(optimize, "fp32")]
    # a plain export is the same files on either device: one folder
    assert zoo.transformer_export_name("tiny-flux", "fp32", "plain", None, None, device) == "tiny-flux-fp32-plain"


def test_the_transformer_scenario_with_dtypes_bf16_exports_bfloat16_transformers(tmp_path, monkeypatch, capsys):
    from optimum_iobinding.bench.cli import main

    calls = recorded_transformer_exports(monkeypatch)
    assert (
        main(
            [
                "--scenario",
                "transformer",
                "--models",
                "tiny-sd3,tiny-flux",
                "--dtypes",
                "bf16",
                "--export-only",
                "--work",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert [(call["dtype"], call["optimize"]) for call in calls] == [("bf16", "cuda")] * 2
    assert capsys.readouterr().out.split() == [
        str(tmp_path / "tiny-sd3-bf16-optimized"),
        str(tmp_path / "tiny-flux-bf16-optimized"),
    ]


def test_an_export_for_an_unknown_device_is_refused_naming_the_device():
    from optimum_iobinding.bench.zoo import optimize_target
    from optimum_iobinding.errors import ArgumentError

    with pytest.raises(ArgumentError, match="^device: expected one of cuda, cpu, got 'tpu'$"):
        optimize_target("optimized", "tpu")


def failing_transformer_run(failing_peer):
    """The transformer scenario's peer processes, answered at once: ``failing_peer``'s with a traceback's end."""

    def run(args, pythonpath, timeout):
        peer = args[args.index("--run-transformer") + 1]
        if peer == failing_peer:
            return {
                "error": 'Traceback (most recent call last):\n  File "x.py", line 1\nRuntimeError: '
                "[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Failed to find kernel for "
                "com.microsoft.NhwcConv(1)\n"
            }
        return transformer_peer(500.0, 21.0, image=None)

    return run


def transformer_cpu_run(tmp_path, monkeypatch, run, export=None):
    """``bench --scenario transformer --models tiny-sd3 --peers ours,torch --device cpu`` with the peers' processes
    answered by ``run`` and the export by ``export`` (a folder by default); its exit status."""
    import optimum_iobinding.bench.cli as cli

    benchmark = cli.transformer_benchmark
    monkeypatch.setattr(cli, "transformer_benchmark", lambda *args, **kwargs: benchmark(*args, **kwargs, run=run))
    monkeypatch.setattr(cli, "ensure_transformer_export", export or (lambda *args, **kwargs: tmp_path / "export"))
    monkeypatch.setattr(cli, "environment", lambda: {"device": "CPU", "command": "bench", "date": "today"})
    return cli.main(
        [
            *TRANSFORMER_CPU_RUN,
            "--models",
            "tiny-sd3",
            "--peers",
            "ours,torch",
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(tmp_path / "out"),
        ]
    )


def test_the_bench_fails_where_ours_fails_naming_the_model_and_the_reason_in_one_line(tmp_path, monkeypatch, capsys):
    assert transformer_cpu_run(tmp_path, monkeypatch, failing_transformer_run("ours")) == 1
    output = capsys.readouterr()
    assert output.err.strip().splitlines()[-1] == (
        "optimum-iobinding: error: ours failed on tiny-sd3: RuntimeError: [ONNXRuntimeError] : 9 : "
        "NOT_IMPLEMENTED : Failed to find kernel for com.microsoft.NhwcConv(1) (see "
        f"{tmp_path / 'out' / 'transformer.md'})"
    )
    assert "| tiny-sd3 64² | full model | torch | 500.0 |" in output.out  # the report is written all the same


def test_a_peer_that_fails_stays_a_row_of_the_report_and_the_bench_succeeds(tmp_path, monkeypatch, capsys):
    assert transformer_cpu_run(tmp_path, monkeypatch, failing_transformer_run("torch")) == 0
    output = capsys.readouterr()
    assert "| tiny-sd3 64² | full model | torch | failed: RuntimeError:" in output.out
    assert "error" not in output.err


def test_the_bench_fails_where_ours_has_no_export(tmp_path, monkeypatch, capsys):
    def export(*args, **kwargs):
        raise RuntimeError("the optimizer died")

    assert transformer_cpu_run(tmp_path, monkeypatch, failing_transformer_run(None), export) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "optimum-iobinding: error: tiny-sd3: the export failed: RuntimeError: the optimizer died (see "
        f"{tmp_path / 'out' / 'transformer.md'})"
    )


@pytest.mark.parametrize(
    "scenario, row, reason",
    [
        (
            "single",
            {
                "model": "tiny",
                "dtype": "fp16",
                "export": "plain",
                "peers": {"numpy": {"error": "Traceback\nRuntimeError: numpy"}, "graph": {"error": "x\nOSError: y"}},
            },
            "graph failed on tiny fp16 plain: OSError: y",
        ),
        (
            "single",
            {
                "model": "tiny",
                "dtype": "fp16",
                "export": "plain",
                "peers": {"numpy": {"error": "Traceback\nRuntimeError: numpy"}, "graph": peer(1.0, 1.0)},
            },
            None,
        ),
        (
            "mixed",
            {
                "model": "tiny",
                "dtype": "fp16",
                "export": "plain",
                "peers": {"warmed": {"error": "timed out after 900 s"}},
            },
            "warmed failed on tiny fp16 plain: timed out after 900 s",
        ),
        (
            "stream",
            {
                "steps": 2,
                "strength": 0.5,
                "stream_batch": True,
                "vae": "tiny",
                "unet_steps": 1,
                "peers": {
                    "ours": {"peer": "ours", "error": "the tiny VAE export failed: OSError: disk full"},
                    "torch": {"error": "boom"},
                },
            },
            "ours failed on 1 step, tiny VAE: the tiny VAE export failed: OSError: disk full",
        ),
        (
            "stream",
            {
                "steps": 2,
                "strength": 0.5,
                "stream_batch": True,
                "vae": "full",
                "unet_steps": 1,
                "peers": {"ours": {"fps": 10.0}, "torch": {"error": "boom"}},
            },
            None,
        ),
        (
            "transformer",
            {
                "model": "tiny-flux",
                "peers": {
                    "ours": transformer_peer(1.0, 1.0),
                    "cached": {"error": "x\nArgumentError: config: no parts"},
                },
            },
            "cached failed on tiny-flux: ArgumentError: config: no parts",
        ),
    ],
)
def test_every_scenario_fails_on_its_own_pipelines_failures_and_not_on_its_peers(scenario, row, reason):
    from optimum_iobinding.bench.cli import own_failure

    assert own_failure({"rows": [row]}, scenario) == reason


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["/usr/bin/optimum-iobinding", "bench", "--models", "sd15"], "optimum-iobinding bench --models sd15"),
        (["/site/optimum_iobinding/bench/cli.py", "--models", "sd15"], "optimum-iobinding bench --models sd15"),
        (
            ["benchmarks/step_cache_probe.py", "--kind", "flux-dev"],
            "python3 benchmarks/step_cache_probe.py --kind flux-dev",
        ),
    ],
)
def test_a_result_names_the_command_that_made_it_a_scripts_too(monkeypatch, argv, expected):
    from optimum_iobinding.bench.probes import command_line

    monkeypatch.setattr(sys, "argv", argv)
    assert command_line() == expected


# ------------------------------------------------------------------------------------------------- step caching
@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--cache", "fbc"],
            "--cache: expected fbc:THRESHOLD (First-Block Cache: SD3, FLUX.1, Wan) or deepcache:INTERVAL"
            "[:BRANCH] (DeepCache: SD, SDXL), got 'fbc'",
        ),
        (["--cache", "deepcache:x"], "--cache: expected fbc:THRESHOLD"),
        (
            ["--models", "sd15", "--cache", "fbc:0.08"],
            "--cache: expected deepcache:INTERVAL[:BRANCH] (DeepCache) for the UNets of --models (sd15), got 'fbc:0.08'; "
            "First-Block Cache (fbc) is SD3's and FLUX.1's: --scenario transformer",
        ),
        (
            ["--scenario", "transformer", "--cache", "deepcache:3"],
            "--cache: expected fbc:THRESHOLD (First-Block Cache) for the diffusion transformers of --models (sd35m, "
            "flux-schnell, flux-dev), got 'deepcache:3'; DeepCache (deepcache) is the UNets': --scenario single",
        ),
        (
            ["--scenario", "mixed", "--cache", "deepcache:3"],
            "--cache: expected only with --scenario single or transformer, got '--scenario mixed'",
        ),
        (
            ["--scenario", "stream", "--cache", "deepcache:3"],
            "--cache: expected only with --scenario single or transformer, got '--scenario stream'",
        ),
        (
            ["--peers", "numpy,graph", "--cache", "deepcache:3"],
            "--peers: expected defaults among them with --cache, got 'numpy,graph'; the cached row's speed-up is over "
            "defaults, on the same files",
        ),
        (
            ["--scenario", "transformer", "--models", "tiny-sd3", "--blocks", "1", "--cache", "fbc:0.08"],
            "--cache: expected transformers of at least 2 blocks (First-Block Cache runs the first and skips the others), "
            "got 'tiny-sd3 with --blocks 1: 1 block'; raise --blocks",
        ),
    ],
)
def test_the_bench_cli_refuses_a_cache_its_scenario_or_models_cannot_take_before_any_work(argv, message, capsys):
    from optimum_iobinding.bench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and error.startswith(f"optimum-iobinding: error: {message}")


def test_with_a_cache_defaults_and_cached_run_on_one_step_cache_export_and_only_cached_caches(tmp_path, monkeypatch):
    import optimum_iobinding.bench.cli as cli

    calls, exports = [], []

    def fake_subprocess(args, pythonpath, timeout):
        if "--run-floor" in args:
            return {"per_step_ms": 1.0}
        calls.append(args)
        name = args[args.index("--run-peer") + 1]
        result = {**peer({"numpy": 300.0, "defaults": 100.0, "cached": 40.0}[name], 1.0), "peer": name}
        if name == "cached":
            result.update(cache="deepcache:3", computed=[True, False, False] * 10, skipped_steps=20)
        return result

    def fake_export(kind, dtype, export, work, step_cache):
        exports.append(step_cache)
        return tmp_path / "export-step-cache"

    monkeypatch.setattr(cli, "run_in_subprocess", fake_subprocess)
    monkeypatch.setattr(cli, "ensure_export", fake_export)
    monkeypatch.setattr(cli, "environment", lambda: {"device": "GPU", "command": "bench"})
    results = cli.benchmark(
        ["sd15"],
        ["fp16"],
        ["optimized"],
        ["numpy", "defaults"],
        30,
        3,
        1,
        tmp_path,
        tmp_path / "out",
        None,
        60,
        cache="deepcache:3",
    )
    assert exports == [True]
    assert [args[args.index("--run-peer") + 1] for args in calls] == ["numpy", "defaults", "cached"]
    assert [args[args.index("--folder") + 1] for args in calls] == [str(tmp_path / "export-step-cache")] * 3
    assert ["--cache" in args for args in calls] == [False, False, True]
    cached = results["rows"][0]["peers"]["cached"]
    assert cached["speedup_vs_uncached"] == 2.5 and results["cache"] == "deepcache:3"


def test_the_report_names_a_cached_rows_cache_its_skipped_steps_and_its_speed_up(tmp_path):
    cached = {
        **peer(40.0, 1.2),
        "cache": "deepcache:3",
        "computed": [True, False, False] * 10,
        "skipped_steps": 20,
        "speedup_vs_uncached": 2.5,
    }
    results = {
        "environment": {"device": "GPU", "command": "optimum-iobinding bench --cache deepcache:3"},
        "steps": 30,
        "runs": 3,
        "warmup": 1,
        "cache": "deepcache:3",
        "rows": [
            {
                "model": "sd15",
                "size": 512,
                "dtype": "fp16",
                "export": "optimized",
                "reference": "numpy",
                "floor": {"per_step_ms": 3.0},
                "peers": {"numpy": peer(300.0, 9.0), "defaults": peer(100.0, 3.0), "cached": cached},
            }
        ],
    }
    write_report(results, tmp_path)
    table = (tmp_path / "results.md").read_text()
    assert (
        "| sd15 512² | fp16 | optimized | cached (deepcache:3; 20 of 30 steps skipped; 2.50 × defaults) | 40.0 "
        "| 1.20 | 7.50 | 0.400 |" in table
    )
    assert "cached: defaults with the step cache `deepcache:3`" in table
    header = table.splitlines()[4]
    assert all(line.count("|") == header.count("|") for line in table.splitlines()[4:] if line.startswith("|"))


def test_the_transformer_scenario_with_a_cache_runs_tiny_flux_cached_beside_ours_on_the_cpu(tmp_path, monkeypatch):
    import json

    import optimum_iobinding.bench.cli as cli

    def in_this_process(args, pythonpath, timeout):  # the peer's own entry point, without a new interpreter
        result_path = tmp_path / "result.json"
        assert cli.main([*args, "--result", str(result_path)]) == 0
        return json.loads(result_path.read_text())

    benchmark = cli.transformer_benchmark
    monkeypatch.setattr(
        cli, "transformer_benchmark", lambda *args, **kwargs: benchmark(*args, **kwargs, run=in_this_process)
    )
    assert (
        cli.main(
            [
                *TRANSFORMER_CPU_RUN,
                "--models",
                "tiny-flux",
                "--peers",
                "ours",
                "--exports",
                "plain",
                "--cache",
                "fbc:10",
                "--work",
                str(tmp_path / "work"),
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    (row,) = json.loads((tmp_path / "out" / "transformer.json").read_text())["rows"]
    ours, cached = row["peers"]["ours"], row["peers"]["cached"]
    # a threshold no residual change reaches: the first step runs whole, the others reuse it
    assert cached["computed"] == [True, False, False] and cached["skipped_steps"] == 2
    assert cached["cache"] == "fbc:10" and "cache" not in ours and "computed" not in ours
    assert cached["speedup_vs_uncached"] == pytest.approx(ours["end_to_end_ms"] / cached["end_to_end_ms"])
    assert (
        "| tiny-flux 64² | full model | cached (fbc:10; 2 of 3 steps skipped) |"
        in (tmp_path / "out" / "transformer.md").read_text()
    )


class SteadyStepsNoisyStart:
    """A pipeline whose steps take ``step_s`` each and whose calls at one step start late by ``late_s`` (the host
    busy elsewhere while they were timed): what the CPU's tiny models meet, where a step is a few ms."""

    def __init__(self, step_s=0.004, late_s=0.05):
        self.step_s, self.late_s = step_s, late_s

    def set_progress_bar_config(self, **config):
        pass

    def __call__(self, prompt, num_inference_steps, callback_on_step_end=None, **kwargs):
        import time

        if num_inference_steps == 1:
            time.sleep(self.late_s)
        for step in range(num_inference_steps):
            time.sleep(self.step_s)
            if callback_on_step_end is not None:
                callback_on_step_end(self, step, step, {})
        return type("Output", (), {"images": np.zeros((1, 8, 8, 3), np.float32)})()


def test_on_the_cpu_a_step_is_timed_inside_the_calls_not_by_the_difference_of_two_noisy_medians(tmp_path, monkeypatch):
    """The difference of the medians at 3 and at 1 step came out negative (-6.99 ms) where the calls at one step
    met more noise than a step's time; on the CPU a step ends when its work is done, so its end marks time it."""
    import torch

    import optimum_iobinding.bench.transformer_peers as transformer_peers

    pipe = SteadyStepsNoisyStart()
    monkeypatch.setattr(
        transformer_peers, "load_transformer_peer", lambda *args, **kwargs: (pipe, torch.zeros(1), {"weights": "x"})
    )
    result = transformer_peers.run_transformer_peer(
        "torch", tmp_path, "tiny-sd3", None, None, 3, 0, "cpu", tmp_path / "image.npy"
    )
    assert result["per_step_ms"] >= pipe.step_s * 1000  # every step sleeps that long; no start counts in it
    assert result["per_step_ms"] < pipe.late_s * 1000


# ------------------------------------------------------------------------------------------ the video scenario
def test_the_video_scenario_runs_the_tiny_wan_model_end_to_end_on_the_cpu(tmp_path, monkeypatch):
    import json

    import onnx

    import optimum_iobinding.bench.cli as cli

    def in_this_process(args, pythonpath, timeout, **pinned):  # each process's entry point, without a new interpreter
        result_path = tmp_path / "result.json"
        assert cli.main([*args, "--result", str(result_path)]) == 0
        return json.loads(result_path.read_text())

    monkeypatch.setattr(cli, "run_in_subprocess", in_this_process)
    out, work = tmp_path / "out", tmp_path / "work"
    argv = ["--scenario", "video", "--tiny", "--blocks", "1", "--mlperf-blocks", "1", "--runs", "1", "--warmup", "0"]
    assert cli.main([*argv, "--work", str(work), "--out", str(out)]) == 0
    results = json.loads((out / "video.json").read_text())
    assert (results["device"], results["dtype"], results["export"], results["steps"]) == ("cpu", "fp32", "optimized", 3)
    assert results["exports_ahead"] is False  # on the CPU the exports have no GPU work to run beside
    video, mlperf = results["rows"]
    # the text-to-video export: UMT5, the transformer of 1 block and the VAE's decoder (text to video never encodes),
    # fused for the CPU; ours ran it there
    folder = work / "tiny-wan-fp32-optimized-cpu-blocks1"
    assert video["folder"] == str(folder) and not (folder / "vae_encoder").exists()
    ops = [node.op_type for node in onnx.load(str(folder / "transformer" / "model.onnx")).graph.node]
    assert ops.count("MultiHeadAttention") == 2 and "ScatterND" not in ops
    ours, torch_peer = video["peers"]["ours"], video["peers"]["torch"]
    assert list(video["peers"]) == ["ours", "torch"]  # diffusers' ran first (it needs no export); the table keeps order
    assert set(ours["providers"].values()) == {"CPUExecutionProvider"}
    for result in (ours, torch_peer):
        assert result["frames_shape"] == [1, 9, 32, 32, 3] and result["frame_stats"]["non_finite"] == 0.0
        assert len(result["per_step_ms_all"]) == 1 and result["per_step_ms"] > 0 and result["vae_decode_s"] > 0
        # the recipe's 50 steps at the measured cost of a step: 47 more than the 3 timed
        assert result["recipe_steps_estimate_s"] == pytest.approx(
            result["end_to_end_s"] + 47 * result["per_step_ms"] / 1000
        )
    # the same float32 weights through ONNX Runtime and through diffusers' torch pipeline: the same video
    assert torch_peer["weights"] == "the export's" and torch_peer["max_abs_diff_vs_ours"] < 1e-3
    # the MLPerf shape's table: the transformer alone, exported alone, one guided call of two rows
    assert mlperf["folder"] == str(work / "tiny-wan-transformer-fp32-optimized-cpu-blocks1")
    assert [path.parent.name for path in Path(mlperf["folder"]).glob("*/model.onnx")] == ["transformer"]
    for result in mlperf["peers"].values():
        assert result["inputs"]["hidden_states"] == [2, 16, 3, 4, 6] and result["step_ms"] > 0
        assert result["full_depth_estimate_ms"] == pytest.approx(result["step_ms"] * 2)  # 1 block of 2
    table = (out / "video.md").read_text()
    assert "| ours |" in table and "| torch |" in table and "1 of 2 blocks (not the full model)" in table
    assert "compile" not in video["peers"] and "floor" not in video["peers"]  # CUDA work: not a CPU run's peers


def test_the_cold_start_table_gathers_each_models_peers_with_their_ratio_to_its_baseline(tmp_path, monkeypatch):
    from optimum_iobinding.bench.coldstart import coldstart_benchmark

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "users-cache"))
    asked, caches = [], []

    def peer(load, first):
        return {"import_s": 1.0, "load_s": load, "first_image_s": first, "end_to_end_ms": 1.0}

    def run_single(**kwargs):
        asked.append(("single", kwargs["models"], kwargs["peers"], kwargs["steps"], kwargs["runs"]))
        caches.append(os.environ["XDG_CACHE_HOME"])
        if kwargs["peers"] == ["defaults"]:  # ours again: a later load of the same files
            return {"rows": [{"peers": {"defaults": peer(0.6, 1.4)}}]}
        assert not os.listdir(caches[-1])  # the first load: an empty cache folder of the run's own
        return {"rows": [{"peers": {"numpy": peer(1.5, 4.5), "defaults": peer(0.6, 2.4)}}]}

    def run_transformer(**kwargs):
        asked.append(("transformer", kwargs["models"], kwargs["peers"], kwargs["blocks"], kwargs["text_layers"]))
        return {"rows": [{"peers": {"optimum": peer(2.0, 3.0), "ours": {"error": "Traceback ...\nRuntimeError: x"}}}]}

    results = coldstart_benchmark(
        ["sd15", "flux-schnell"], tmp_path, tmp_path / "out", None, 60, 60, run_single, run_transformer, {}
    )
    assert asked == [
        ("single", ["sd15"], ["numpy", "defaults"], 30, 1),
        ("single", ["sd15"], ["defaults"], 30, 1),
        ("transformer", ["flux-schnell"], ["optimum", "ours"], 2, 4),
        ("transformer", ["flux-schnell"], ["ours"], 2, 4),
    ]
    assert caches[0] == caches[1] != str(tmp_path / "users-cache")  # both loads share the run's own cache
    assert os.environ["XDG_CACHE_HOME"] == str(tmp_path / "users-cache")  # restored after
    ratios = {(row["model"], row["peer"]): row.get("over_baseline") for row in results["rows"]}
    assert ratios == {("sd15", "numpy"): 1.0, ("sd15", "defaults"): 0.5, ("sd15", "defaults (a later load)"): 1 / 3,
                      ("flux-schnell", "optimum"): 1.0, ("flux-schnell", "ours"): None,
                      ("flux-schnell", "ours (a later load)"): None}  # fmt: skip
    table = (tmp_path / "out" / "coldstart.md").read_text()
    assert "| sd15 | defaults | 1.00 | 0.60 | 2.40 | 3.00 | 0.50 |" in table
    assert "| sd15 | defaults (a later load) | 1.00 | 0.60 | 1.40 | 2.00 | 0.33 |" in table
    assert "| flux-schnell | ours | failed: RuntimeError: x |" in table
    assert json.loads((tmp_path / "out" / "coldstart.json").read_text())["rows"] == results["rows"]


def test_a_repeated_cold_start_swaps_the_order_uses_a_cache_folder_each_and_reports_the_medians(tmp_path):
    from optimum_iobinding.bench.coldstart import coldstart_benchmark

    asked, caches = [], []
    firsts = iter([4.5, 2.0, 3.0, 2.2, 5.0, 2.6])  # numpy and ours' first images, run by run
    later = iter([1.4, 1.2, 1.6])

    def peer(load, first):
        return {"import_s": 1.0, "load_s": load, "first_image_s": first, "end_to_end_ms": 1.0}

    def run_single(**kwargs):
        asked.append((kwargs["peers"], kwargs["out"].name))
        caches.append(os.environ["XDG_CACHE_HOME"])
        if kwargs["peers"] == ["defaults"]:
            return {"rows": [{"peers": {"defaults": peer(0.5, next(later))}}]}
        assert not os.listdir(caches[-1])  # each run's first load: an empty cache folder of its own
        numpy, ours = next(firsts), next(firsts)
        return {"rows": [{"peers": {"numpy": peer(1.5, numpy), "defaults": peer(0.5, ours)}}]}

    results = coldstart_benchmark(["sd15"], tmp_path, tmp_path / "out", None, 60, 60, run_single, None, {}, repeats=3)
    assert asked == [
        (["numpy", "defaults"], "sd15"),
        (["defaults"], "sd15-later"),
        (["defaults", "numpy"], "sd15-run2"),
        (["defaults"], "sd15-run2-later"),
        (["numpy", "defaults"], "sd15-run3"),
        (["defaults"], "sd15-run3-later"),
    ]
    assert caches[0] == caches[1] and len({caches[0], caches[2], caches[4]}) == 3
    medians = {row["peer"]: row for row in results["rows"] if row.get("run") == "median"}
    assert medians["numpy"]["cold_s"] == 1.5 + 4.5 and medians["defaults"]["cold_s"] == 0.5 + 2.2
    assert medians["defaults"]["over_baseline"] == pytest.approx(2.7 / 6.0)
    assert medians["defaults (a later load)"]["first_image_s"] == 1.4 and medians["numpy"]["runs"] == 3
    assert [row["run"] for row in results["rows"] if row["peer"] == "numpy"] == [1, 2, 3, "median"]
    table = (tmp_path / "out" / "coldstart.md").read_text()
    assert "| sd15 | defaults, run 2 | 1.00 | 0.50 | 2.20 | 2.70 | 0.60 |" in table  # against its own run's numpy
    assert "| sd15 | **defaults: median of 3** | 1.00 | 0.50 | 2.20 | 2.70 | 0.45 |" in table


def test_a_video_export_with_a_float16_vae_is_a_folder_of_its_own():
    from optimum_iobinding.bench.zoo import video_export_name

    plain = video_export_name("wan2.1-t2v-1.3b", "fp16", "optimized", None, 2)
    assert video_export_name("wan2.1-t2v-1.3b", "fp16", "optimized", None, 2, vae_dtype="fp32") == plain
    assert plain == "wan2.1-t2v-1.3b-fp16-optimized-text2"
    float16 = video_export_name("wan2.1-t2v-1.3b", "fp16", "optimized", None, 2, vae_dtype="fp16")
    assert float16 == "wan2.1-t2v-1.3b-fp16-optimized-vae16-text2"
