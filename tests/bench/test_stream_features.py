"""The stream scenario's feature rows (``--stream-features``): guidance, the similarity filter and a ControlNet, each
a row after the plain ones — their settings, labels and report, which peers run them on which export, the option's
checks, and each feature's row through ours and the floor's inputs on the tiny random model on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

FEATURES = (
    "full-cfg",
    "rcfg-self",
    "rcfg-initialize",
    "filter-still",
    "filter-moving",
    "controlnet",
    "controlnet-per-frame",
)
# the plain rows, before the features: (UNet steps, stream batch, VAE)
PLAIN_ROWS = [
    (1, True, "full"),
    (1, True, "tiny"),
    (2, True, "full"),
    (2, True, "tiny"),
    (2, False, "full"),
    (2, False, "tiny"),
]


# ----------------------------------------------------------------------------------------------------- the rows
def test_every_feature_is_a_row_after_the_plain_ones_at_one_step_with_the_tiny_vae():
    from optimum_iobinding.bench.cli import STREAM_FEATURES, stream_config, stream_rows

    assert tuple(STREAM_FEATURES) == FEATURES
    plain = stream_rows()
    rows = stream_rows(list(reversed(FEATURES)))  # in the scenario's order whatever the order given
    assert rows[: len(plain)] == plain and [tuple(row) for row in plain] == [
        ("steps", "strength", "stream_batch", "vae", "unet_steps", "peers")
    ] * len(PLAIN_ROWS)
    assert [(row["unet_steps"], row["stream_batch"], row["vae"]) for row in plain] == PLAIN_ROWS
    features = rows[len(plain) :]
    assert [row["feature"] for row in features] == list(FEATURES)
    configurations = {
        (row["steps"], row["strength"], row["stream_batch"], row["vae"], row["unet_steps"]) for row in features
    }
    assert configurations == {(2, 0.5, True, "tiny", 1)}  # the first configuration, 1 UNet step, the tiny VAE
    settings = {row["feature"]: stream_config(row) for row in features}
    assert settings["rcfg-self"] == {
        "steps": 2,
        "strength": 0.5,
        "stream_batch": True,
        "vae": "tiny",
        "feature": "rcfg-self",
        "guidance_scale": 1.5,
        "cfg_type": "self",
        "clip": "moving",
    }
    assert [settings[name]["cfg_type"] for name in FEATURES[:3]] == ["full", "self", "initialize"]
    assert [(settings[name]["similarity_threshold"], settings[name]["clip"]) for name in FEATURES[3:5]] == [
        (0.98, "still"),
        (0.98, "moving"),
    ]
    assert [(settings[name]["controlnets"], settings[name]["control"]) for name in FEATURES[5:]] == [
        (1, "fixed"),
        (1, "per-frame"),
    ]
    # a plain row's peers are told what they were told before: its configuration alone
    assert stream_config(plain[0]) == {"steps": 2, "strength": 0.5, "stream_batch": True, "vae": "full"}


def test_an_unknown_feature_is_refused_naming_the_known_ones():
    from optimum_iobinding.bench.cli import stream_rows
    from optimum_iobinding.errors import ArgumentError

    with pytest.raises(ArgumentError, match="features: expected names among full-cfg, .*got \\['rcfg'\\]"):
        stream_rows(["rcfg-self", "rcfg"])


def test_each_feature_row_is_labelled_by_its_feature():
    from optimum_iobinding.bench.cli import stream_rows
    from optimum_iobinding.bench.report import stream_row_label

    labels = {row.get("feature"): stream_row_label(row) for row in stream_rows(FEATURES)}
    assert labels == {
        None: "2 steps in turn, tiny VAE",  # the last plain row's
        "full-cfg": "1 step, tiny VAE, guidance 1.5 (cfg_type full)",
        "rcfg-self": "1 step, tiny VAE, guidance 1.5 (cfg_type self)",
        "rcfg-initialize": "1 step, tiny VAE, guidance 1.5 (cfg_type initialize)",
        "filter-still": "1 step, tiny VAE, similarity filter 0.98, still clip",
        "filter-moving": "1 step, tiny VAE, similarity filter 0.98, moving clip",
        "controlnet": "1 step, tiny VAE, ControlNet, fixed control image",
        "controlnet-per-frame": "1 step, tiny VAE, ControlNet, control image per frame",
    }
    two = {**stream_rows(["controlnet"])[-1], "controlnets": 2}
    assert stream_row_label(two) == "1 step, tiny VAE, 2 ControlNets, fixed control image"


# --------------------------------------------------------------------------------------------- the benchmark
def fake_stream_peers(calls):
    """A ``run`` for stream_benchmark that records each peer's arguments and answers as a peer would."""

    def run(args, pythonpath, timeout):
        peer = args[args.index("--run-stream") + 1]
        calls.append((peer, args))
        if peer == "video":
            return {"peer": peer, "frames": 30, "codec_fps": 300.0, "command_fps": 80.0, "in_memory_host_fps": 90.0}
        if peer == "floor":
            parts = {"vae_encoder": 2.0, "unet": 5.0, "vae_decoder": 1.0}
            return {"peer": peer, "frame_ms": 8.0, "fps": 125.0, "parts_ms": parts, "unet_batch": 1, "unet_calls": 1}
        return {"peer": peer, "p50_ms": 10.0, "p99_ms": 11.0, "fps": 100.0, "latency_ms_all": [10.0]}

    return run


def stream_run(tmp_path, monkeypatch, peers, features, controlnet_export):
    import optimum_iobinding.bench.cli as cli

    calls, exports = [], []

    def ensure_controlnet(kind, dtype, export, work, controlnets):
        exports.append((kind, dtype, export, work, controlnets))
        return controlnet_export(tmp_path)

    monkeypatch.setattr(cli, "ensure_export", lambda kind, dtype, export, work: tmp_path / f"{kind}-{dtype}-{export}")
    monkeypatch.setattr(cli, "ensure_tiny_vae_export", lambda dtype, export, work: tmp_path / "taesd")
    monkeypatch.setattr(cli, "ensure_controlnet_export", ensure_controlnet)
    monkeypatch.setattr(cli, "environment", lambda: {"device": "GPU", "command": "bench", "date": "today"})
    results = cli.stream_benchmark(
        peers, "fp16", "optimized", 50, 30, 5, tmp_path, tmp_path / "out", 60, run=fake_stream_peers(calls), **features
    )
    return results, calls, exports


def test_feature_rows_run_ours_and_the_floor_alone_the_controlnet_ones_on_the_controlnet_export(tmp_path, monkeypatch):
    results, calls, exports = stream_run(
        tmp_path,
        monkeypatch,
        ["ours", "numpy", "torch", "floor", "video"],
        {"features": FEATURES},
        lambda work: work / "turbo-controlnet1-fp16-optimized",
    )
    rows = results["rows"]
    assert [row.get("feature") for row in rows] == [None] * len(PLAIN_ROWS) + list(FEATURES)
    for row in rows[len(PLAIN_ROWS) :]:
        assert list(row["peers"]) == ["ours", "floor"] and row["peers"]["ours"]["fps"] == 100.0
    # the plain rows keep every peer (the video on their 1-step rows)
    assert list(rows[1]["peers"]) == ["ours", "numpy", "torch", "floor", "video"]
    # one ControlNet export for both ControlNet rows, the scenario's model, dtype and export under --work
    assert exports == [("turbo", "fp16", "optimized", tmp_path, 1)]
    feature_calls = {}
    for peer, args in calls:
        config = json.loads(args[args.index("--stream-config") + 1])
        if "feature" in config:
            feature_calls.setdefault(config["feature"], []).append((peer, args, config))
    assert list(feature_calls) == list(FEATURES)
    for name, runs in feature_calls.items():
        assert [peer for peer, _, _ in runs] == ["ours", "floor"]
        for peer, args, config in runs:
            folder = args[args.index("--folder") + 1]
            expected = "turbo-controlnet1-fp16-optimized" if name.startswith("controlnet") else "turbo-fp16-optimized"
            assert folder == str(tmp_path / expected)
            assert args[args.index("--tiny-vae-folder") + 1] == str(tmp_path / "taesd")
    assert feature_calls["filter-still"][0][2]["similarity_threshold"] == 0.98
    assert feature_calls["filter-still"][0][2]["clip"] == "still"
    assert feature_calls["controlnet-per-frame"][0][2]["control"] == "per-frame"
    table = (tmp_path / "out" / "stream.md").read_text()
    assert "| rcfg-initialize | 1 step, tiny VAE, guidance 1.5 (cfg_type initialize) | ours | 10.00 |" in table


def test_without_features_or_their_peers_the_scenario_has_its_plain_rows_alone(tmp_path, monkeypatch):
    def no_export(work):
        raise AssertionError("no ControlNet export without a ControlNet row")

    results, calls, _ = stream_run(tmp_path, monkeypatch, ["ours", "floor"], {}, no_export)
    assert [row.get("feature") for row in results["rows"]] == [None] * len(PLAIN_ROWS)
    results, calls, _ = stream_run(tmp_path, monkeypatch, ["numpy", "torch"], {"features": FEATURES}, no_export)
    assert len(results["rows"]) == len(PLAIN_ROWS)
    assert {peer for peer, _ in calls} == {"numpy", "torch"}


def test_a_failed_controlnet_export_fails_the_controlnet_rows_alone(tmp_path, monkeypatch):
    def broken(work):
        raise OSError("disk full")

    results, calls, exports = stream_run(tmp_path, monkeypatch, ["ours", "floor"], {"features": FEATURES}, broken)
    assert len(exports) == 1  # tried once, not once per row
    by_feature = {row.get("feature"): row for row in results["rows"]}
    for name in ("controlnet", "controlnet-per-frame"):
        for peer in ("ours", "floor"):
            assert by_feature[name]["peers"][peer] == {
                "peer": peer,
                "error": "the ControlNet export failed: OSError: disk full",
            }
    assert by_feature["rcfg-self"]["peers"]["ours"]["fps"] == 100.0
    assert not any(json.loads(args[args.index("--stream-config") + 1]).get("control") for _, args in calls)

    from optimum_iobinding.bench.cli import own_failure

    assert own_failure(results, "stream") == (
        "ours failed on 1 step, tiny VAE, ControlNet, fixed control image: the ControlNet export failed: OSError: "
        "disk full"
    )


@pytest.mark.parametrize("peer", ["numpy", "torch", "video"])
def test_a_feature_row_is_refused_by_the_peers_that_do_not_run_it_before_any_work(peer, tmp_path):
    from optimum_iobinding.bench.cli import stream_config, stream_rows
    from optimum_iobinding.bench.peers import PeerUnavailable, run_stream_peer

    config = stream_config(stream_rows(["rcfg-self"])[-1])
    with pytest.raises(PeerUnavailable, match="a feature row is measured by ours, floor alone"):
        run_stream_peer(peer, tmp_path / "no-export", None, config, 10, 1, tmp_path)


# ------------------------------------------------------------------------------------------------- the report
def feature_results():
    from optimum_iobinding.bench.cli import stream_rows

    rows = stream_rows(["rcfg-self", "filter-still", "controlnet"])
    for row in rows:
        row["peers"] = {"ours": {"peer": "ours", "p50_ms": 10.0, "p99_ms": 12.0, "fps": 100.0, "frames": 200}}
        row["peers"]["floor"] = {
            "peer": "floor",
            "frame_ms": 8.0,
            "fps": 125.0,
            "unet_batch": 1,
            "unet_calls": 1,
            "parts_ms": {"vae_encoder": 2.0, "unet": 5.0, "vae_decoder": 1.0},
        }
    by_feature = {row.get("feature"): row for row in rows}
    by_feature["rcfg-self"]["peers"]["ours"].update(p50_ms=12.0, fps=80.0)
    by_feature["filter-still"]["peers"]["ours"].update(
        p50_ms=0.5, fps=400.0, skipped_frames=183, skipped_share=183 / 200
    )
    by_feature["controlnet"]["peers"]["floor"].update(
        frame_ms=11.0,
        fps=1000 / 11.0,
        parts_ms={"vae_encoder": 2.0, "controlnet": 3.0, "unet": 5.0, "vae_decoder": 1.0},
    )
    by_feature["controlnet"]["peers"]["ours"] = {"error": "Traceback …\nRuntimeError: no residuals"}
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


def test_the_report_gives_the_features_their_own_table_with_the_skipped_share_and_the_plain_rows_cost(tmp_path):
    from optimum_iobinding.bench.report import write_stream_report

    write_stream_report(feature_results(), tmp_path)
    table = (tmp_path / "stream.md").read_text()
    main, features = table.split("| feature | configuration |")
    # the plain rows' table is as it was, without the feature rows: a header, its rule and two peers per plain row
    assert "| 1 step, tiny VAE | ours | 10.00 | 12.00 | 100.0 | 1.25 |  |" in main
    main_lines = [line for line in main.splitlines() if line.startswith("|")]
    assert len(main_lines) == 2 + 2 * len(PLAIN_ROWS) and not any("1 step, tiny VAE," in line for line in main_lines)
    # residual guidance: 12 ms against the floor's 8 (1.50); 1000/80 ms a frame against the plain row's 1000/100
    assert (
        "| rcfg-self | 1 step, tiny VAE, guidance 1.5 (cfg_type self) | ours | 12.00 | 12.00 | 80.0 | 1.50 | 1.25 |  |"
        in (features)
    )
    assert (
        "| filter-still | 1 step, tiny VAE, similarity filter 0.98, still clip | ours | 0.50 | 12.00 | 400.0 | 0.06 | "
        "0.25 | 91.5 % (183 of 200) |"
    ) in features
    assert (
        "| controlnet | 1 step, tiny VAE, ControlNet, fixed control image | floor (encoder 2.00 + 1 × (ControlNet "
        "3.00 + UNet 5.00) at batch 1 + decoder 1.00) | 11.00 | | 90.9 | 1.00 | | |"
    ) in features
    assert (
        "| controlnet | 1 step, tiny VAE, ControlNet, fixed control image | ours | failed: RuntimeError: no residuals |"
        in (features)
    )


def test_a_report_without_feature_rows_has_no_feature_table(tmp_path):
    from optimum_iobinding.bench.report import write_stream_report

    results = feature_results()
    results["rows"] = [row for row in results["rows"] if "feature" not in row]
    write_stream_report(results, tmp_path)
    assert "| feature |" not in (tmp_path / "stream.md").read_text()


# -------------------------------------------------------------------------------------------- the command line
@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--scenario", "stream", "--stream-features", "rcfg-self,cfg"],
            "--stream-features: expected a comma-separated list of full-cfg, rcfg-self, rcfg-initialize, "
            "filter-still, filter-moving, controlnet, controlnet-per-frame, or none, got 'rcfg-self,cfg'",
        ),
        (["--scenario", "stream", "--stream-features", ","], "--stream-features: expected a comma-separated list"),
        (
            ["--scenario", "single", "--stream-features", "none"],
            "--stream-features: expected only with --scenario stream, got '--scenario single'",
        ),
    ],
)
def test_the_bench_cli_checks_the_stream_features_before_any_work(argv, message, capsys):
    from optimum_iobinding.bench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_help_names_every_stream_feature(capsys):
    from optimum_iobinding.bench import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0 and "--stream-features NAMES" in capsys.readouterr().out
    (action,) = [action for action in cli.build_parser()._actions if "--stream-features" in action.option_strings]
    assert f"{', '.join(FEATURES)} (default: all of them), or none" in action.help
    assert "--stream-features" in cli.__doc__ and all(f"``{name}``" in cli.__doc__ for name in FEATURES)


@pytest.mark.parametrize(
    "argv, features",
    [
        ([], list(FEATURES)),
        (["--stream-features", "none"], []),
        (["--stream-features", "filter-moving,rcfg-self"], ["filter-moving", "rcfg-self"]),
    ],
)
def test_the_stream_scenario_runs_the_features_it_is_given_all_by_default(argv, features, tmp_path, monkeypatch):
    import optimum_iobinding.bench.cli as cli

    given = []

    def fake_benchmark(peers, dtype, export, frames, video_frames, warmup, work, out, timeout, features=()):
        given.append(list(features))
        out.mkdir(parents=True, exist_ok=True)
        (out / "stream.md").write_text("table\n")
        return {"rows": [{"unet_steps": 1, "stream_batch": True, "vae": "tiny", "peers": {"ours": {"fps": 1.0}}}]}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "stream_benchmark", fake_benchmark)
    assert cli.main(["--scenario", "stream", "--out", str(tmp_path / "out"), *argv]) == 0
    assert given == [features]


@pytest.mark.parametrize(
    "features, controlnet_exports",
    [(None, [1]), ("rcfg-self,filter-still", []), ("controlnet-per-frame", [1]), ("none", [])],
)
def test_the_stream_exports_include_the_controlnet_one_where_a_controlnet_row_is_chosen(
    features, controlnet_exports, tmp_path, monkeypatch, capsys
):
    import optimum_iobinding.bench.cli as cli

    made = []
    monkeypatch.setattr(cli, "ensure_export", lambda kind, dtype, export, work: work / f"{kind}-{dtype}-{export}")
    monkeypatch.setattr(cli, "ensure_tiny_vae_export", lambda dtype, export, work: work / "taesd")
    monkeypatch.setattr(
        cli,
        "ensure_controlnet_export",
        lambda kind, dtype, export, work, count: made.append(count) or work / f"{kind}-controlnet{count}",
    )
    argv = ["--scenario", "stream", "--export-only", "--work", str(tmp_path)]
    assert cli.main(argv + (["--stream-features", features] if features else [])) == 0
    assert made == controlnet_exports
    printed = capsys.readouterr().out.split()
    assert (str(tmp_path / "turbo-controlnet1") in printed) == bool(controlnet_exports)


# ------------------------------------------------------------------------ the rows on the tiny model, on the CPU
SIZE = 64
FRAMES = 12


@pytest.fixture(scope="module")
def tiny_exports(tmp_path_factory):
    """The tiny random model's export and its export with a random ControlNet, through the bench's export cache."""
    from optimum_iobinding.bench.zoo import ensure_controlnet_export, ensure_export

    work = tmp_path_factory.mktemp("bench-work")
    return ensure_export("tiny", "fp32", "plain", work), ensure_controlnet_export("tiny", "fp32", "plain", work)


def test_the_controlnet_export_is_the_models_with_a_controlnet_made_once(tiny_exports, monkeypatch):
    import optimum_iobinding.export as export
    from optimum_iobinding import OnnxStreamDiffusionControlNetPipeline, OnnxStreamDiffusionPipeline
    from optimum_iobinding.bench.zoo import ensure_controlnet_export

    plain, folder = tiny_exports
    assert folder.name == "tiny-controlnet1-fp32-plain" and folder.parent == plain.parent
    assert (folder / "controlnet" / "model.onnx").is_file() and not (plain / "controlnet").exists()
    stream = OnnxStreamDiffusionPipeline.from_pretrained(folder, provider="CPUExecutionProvider")
    assert type(stream) is OnnxStreamDiffusionControlNetPipeline and len(stream.controlnets) == 1

    def no_export(*args, **kwargs):
        raise AssertionError("exported again")

    monkeypatch.setattr(export, "export_pipeline", no_export)
    assert ensure_controlnet_export("tiny", "fp32", "plain", plain.parent) == folder


def test_a_controlnet_export_is_refused_for_sdxl_before_any_work(tmp_path):
    from optimum_iobinding.bench.zoo import ensure_controlnet_export
    from optimum_iobinding.errors import ArgumentError

    with pytest.raises(
        ArgumentError, match="kind: expected one of tiny, small, sd15, turbo for a ControlNet, got 'sdxl'"
    ):
        ensure_controlnet_export("sdxl", "fp16", "optimized", tmp_path)
    with pytest.raises(ArgumentError, match="controlnets: expected an integer ≥ 1, got 0"):
        ensure_controlnet_export("turbo", "fp16", "optimized", tmp_path, 0)
    assert list(tmp_path.iterdir()) == []  # not even a lock file


@pytest.mark.parametrize("feature", [None, *FEATURES])
def test_each_row_prepares_and_feeds_its_feature_and_the_floor_runs_its_models(feature, tiny_exports):
    from optimum_iobinding import OnnxStreamDiffusionControlNetPipeline
    from optimum_iobinding.bench.cli import stream_config, stream_rows
    from optimum_iobinding.bench.peers import control_images, load_stream, measure_stream, stream_floor_inputs

    plain, with_controlnet = tiny_exports
    row = next(row for row in stream_rows([feature] if feature else []) if row.get("feature") == feature)
    config = stream_config(row)
    generator = torch.Generator().manual_seed(0)
    sources = [torch.rand(3, SIZE, SIZE, generator=generator) * 2 - 1 for _ in range(8)]
    controls = control_images(config, SIZE, "cpu")
    assert len(controls) == {"controlnet": 1, "controlnet-per-frame": 8}.get(feature, 0)
    stream = load_stream(
        with_controlnet if config.get("controlnets") else plain,
        None,
        config,
        controls[0] if config.get("control") == "fixed" else None,
        provider="CPUExecutionProvider",
        size=SIZE,
    )
    assert isinstance(stream, OnnxStreamDiffusionControlNetPipeline) == bool(config.get("controlnets"))
    result = measure_stream(stream, config, sources, controls, FRAMES, 2, lambda: None)
    assert result["frames"] == FRAMES and len(result["latency_ms_all"]) == FRAMES and result["unet_steps"] == 1
    if feature == "filter-still":  # one frame again and again: the filter keeps one in max_skip_frame + 2 at most
        assert FRAMES - 2 <= result["skipped_frames"] < FRAMES
        assert result["skipped_share"] == result["skipped_frames"] / FRAMES
    elif feature == "filter-moving":  # every frame new: each kept
        assert result["skipped_frames"] == 0 and result["skipped_share"] == 0.0
    else:
        assert "skipped_share" not in result and stream.skipped_frames == 0

    models = stream_floor_inputs(stream)
    nets = ["controlnet"] if config.get("controlnets") else []
    assert list(models) == ["vae_encoder", *nets, "unet", "vae_decoder"]
    unet, unet_inputs = models["unet"]
    assert unet is stream.unet
    # the guidance's rows: a negative-prompt row beside the latent's ("full"), one for the newest frame
    # ("initialize"), none for residual guidance's "self" and without guidance
    assert unet_inputs["sample"].shape[0] == {"full-cfg": 2, "rcfg-initialize": 2}.get(feature, 1)
    assert set(unet_inputs) == set(unet.input_names)  # a ControlNet's residuals among them
    assert models["vae_encoder"][1]["sample"].shape == (1, 3, SIZE, SIZE)
    assert unet_inputs["sample"] is not stream.unet_inputs["sample"]  # copies: the stream's own are not written
    for model, inputs in models.values():
        assert model(**inputs)[0].shape[0] >= 1  # each runs on the inputs given


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and onnxruntime-gpu")
def test_on_the_gpu_each_feature_row_is_measured_by_ours_and_the_floor_of_its_prepared_models(tmp_path):
    from optimum_iobinding.bench.cli import stream_config, stream_rows
    from optimum_iobinding.bench.peers import run_stream_peer
    from optimum_iobinding.bench.zoo import ensure_controlnet_export, ensure_export, ensure_tiny_vae_export

    work = tmp_path / "work"
    plain = ensure_export("tiny", "fp16", "optimized", work)
    with_controlnet = ensure_controlnet_export("tiny", "fp16", "optimized", work)
    taesd = ensure_tiny_vae_export("fp16", "optimized", work)
    for row in stream_rows(FEATURES)[len(PLAIN_ROWS) :]:
        feature, config = row["feature"], stream_config(row)
        folder = with_controlnet if config.get("controlnets") else plain
        ours = run_stream_peer("ours", folder, taesd, config, 24, 3, work)
        floor = run_stream_peer("floor", folder, taesd, config, 24, 3, work)
        assert ours["frames"] == 24 and len(ours["latency_ms_all"]) == 24 and ours["unet_steps"] == 1, feature
        assert floor["unet_batch"] == {"full-cfg": 2, "rcfg-initialize": 2}.get(feature, 1), feature
        nets = ["controlnet"] if config.get("controlnets") else []
        assert list(floor["parts_ms"]) == ["vae_encoder", *nets, "unet", "vae_decoder"], feature
        assert floor["frame_ms"] == pytest.approx(sum(floor["parts_ms"].values())) and floor["unet_calls"] == 1
        if feature == "filter-still":
            assert 20 <= ours["skipped_frames"] < 24 and ours["skipped_share"] == ours["skipped_frames"] / 24
        elif feature == "filter-moving":
            assert ours["skipped_frames"] == 0
        else:
            assert "skipped_share" not in ours, feature
