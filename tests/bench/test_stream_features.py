"""The stream scenario's feature rows (``--stream-features``): guidance, the similarity filter, a ControlNet and an
IP-Adapter, each a row after the plain ones — their settings, labels and report, which peers run them on which
export, the option's checks, and each feature's row through ours and the floor's inputs on the tiny random model on
the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from tests.bench.test_bench import stream_report_input

FEATURES = (
    "full-cfg",
    "rcfg-self",
    "rcfg-initialize",
    "filter-still",
    "filter-moving",
    "controlnet",
    "controlnet-per-frame",
    "ip-adapter",
    "ip-adapter-per-frame",
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
    assert [(settings[name]["controlnets"], settings[name]["control"]) for name in FEATURES[5:7]] == [
        (1, "fixed"),
        (1, "per-frame"),
    ]
    assert [settings[name] for name in FEATURES[7:]] == [
        {
            "steps": 2,
            "strength": 0.5,
            "stream_batch": True,
            "vae": "tiny",
            "feature": name,
            "ip_adapter_tokens": 4,
            "ip_adapter_scale": 1.0,
            "image_prompt": image_prompt,
            "clip": "moving",
        }
        for name, image_prompt in (("ip-adapter", "fixed"), ("ip-adapter-per-frame", "per-frame"))
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
        "ip-adapter": "1 step, tiny VAE, IP-Adapter (4 image tokens, scale 1), fixed image prompt",
        "ip-adapter-per-frame": "1 step, tiny VAE, IP-Adapter (4 image tokens, scale 1), image prompt per frame",
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


def stream_run(tmp_path, monkeypatch, peers, features, controlnet_export, ip_adapter_export=None, ip_exports=None):
    import optimum_iobinding.bench.cli as cli

    calls, exports = [], []

    def ensure_controlnet(kind, dtype, export, work, controlnets):
        exports.append((kind, dtype, export, work, controlnets))
        return controlnet_export(tmp_path)

    def ensure_ip_adapter(kind, dtype, export, work):
        (ip_exports if ip_exports is not None else []).append((kind, dtype, export, work))
        if ip_adapter_export is None:
            return work / f"{kind}-ip-adapter-{dtype}-{export}"
        return ip_adapter_export(tmp_path)

    monkeypatch.setattr(cli, "ensure_export", lambda kind, dtype, export, work: tmp_path / f"{kind}-{dtype}-{export}")
    monkeypatch.setattr(cli, "ensure_tiny_vae_export", lambda dtype, export, work: tmp_path / "taesd")
    monkeypatch.setattr(cli, "ensure_controlnet_export", ensure_controlnet)
    monkeypatch.setattr(cli, "ensure_ip_adapter_export", ensure_ip_adapter)
    monkeypatch.setattr(cli, "environment", lambda: {"device": "GPU", "command": "bench", "date": "today"})
    results = cli.stream_benchmark(
        peers, "fp16", "optimized", 50, 30, 5, tmp_path, tmp_path / "out", 60, run=fake_stream_peers(calls), **features
    )
    return results, calls, exports


def test_feature_rows_run_ours_and_the_floor_alone_the_controlnet_ones_on_the_controlnet_export(tmp_path, monkeypatch):
    ip_exports = []
    results, calls, exports = stream_run(
        tmp_path,
        monkeypatch,
        ["ours", "numpy", "torch", "floor", "video"],
        {"features": FEATURES},
        lambda work: work / "turbo-controlnet1-fp16-optimized",
        ip_exports=ip_exports,
    )
    rows = results["rows"]
    assert [row.get("feature") for row in rows] == [None] * len(PLAIN_ROWS) + list(FEATURES)
    for row in rows[len(PLAIN_ROWS) :]:
        assert list(row["peers"]) == ["ours", "floor"] and row["peers"]["ours"]["fps"] == 100.0
    # the plain rows keep every peer (the video on their 1-step rows)
    assert list(rows[1]["peers"]) == ["ours", "numpy", "torch", "floor", "video"]
    # one ControlNet export for both ControlNet rows, the scenario's model, dtype and export under --work
    assert exports == [("turbo", "fp16", "optimized", tmp_path, 1)]
    # one export for IP-Adapter for both IP-Adapter rows, likewise
    assert ip_exports == [("turbo", "fp16", "optimized", tmp_path)]
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
            expected = {"controlnet": "turbo-controlnet1-fp16-optimized", "ip": "turbo-ip-adapter-fp16-optimized"}.get(
                name.split("-")[0], "turbo-fp16-optimized"
            )
            assert folder == str(tmp_path / expected)
            assert args[args.index("--tiny-vae-folder") + 1] == str(tmp_path / "taesd")
    assert feature_calls["filter-still"][0][2]["similarity_threshold"] == 0.98
    assert feature_calls["filter-still"][0][2]["clip"] == "still"
    assert feature_calls["controlnet-per-frame"][0][2]["control"] == "per-frame"
    assert feature_calls["ip-adapter-per-frame"][0][2]["image_prompt"] == "per-frame"
    table = (tmp_path / "out" / "stream.md").read_text()
    assert "| rcfg-initialize | 1 step, tiny VAE, guidance 1.5 (cfg_type initialize) | ours | 10.00 |" in table


def test_without_features_or_their_peers_the_scenario_has_its_plain_rows_alone(tmp_path, monkeypatch):
    def no_export(work):
        raise AssertionError("no ControlNet export without a ControlNet row")

    ip_exports = []
    results, calls, _ = stream_run(tmp_path, monkeypatch, ["ours", "floor"], {}, no_export, ip_exports=ip_exports)
    assert [row.get("feature") for row in results["rows"]] == [None] * len(PLAIN_ROWS)
    results, calls, _ = stream_run(
        tmp_path, monkeypatch, ["numpy", "torch"], {"features": FEATURES}, no_export, ip_exports=ip_exports
    )
    assert len(results["rows"]) == len(PLAIN_ROWS)
    assert {peer for peer, _ in calls} == {"numpy", "torch"}
    assert ip_exports == []  # no export for IP-Adapter without an IP-Adapter row either


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


def test_a_failed_ip_adapter_export_fails_the_ip_adapter_rows_alone(tmp_path, monkeypatch):
    def broken(work):
        raise OSError("disk full")

    ip_exports = []
    results, calls, _ = stream_run(
        tmp_path,
        monkeypatch,
        ["ours", "floor"],
        {"features": FEATURES},
        lambda work: work / "turbo-controlnet1-fp16-optimized",
        ip_adapter_export=broken,
        ip_exports=ip_exports,
    )
    assert len(ip_exports) == 1  # tried once, not once per row
    by_feature = {row.get("feature"): row for row in results["rows"]}
    for name in ("ip-adapter", "ip-adapter-per-frame"):
        for peer in ("ours", "floor"):
            assert by_feature[name]["peers"][peer] == {
                "peer": peer,
                "error": "the IP-Adapter export failed: OSError: disk full",
            }
    assert by_feature["controlnet"]["peers"]["ours"]["fps"] == 100.0
    assert not any(json.loads(args[args.index("--stream-config") + 1]).get("image_prompt") for _, args in calls)


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
    return stream_report_input(rows)


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


def test_the_report_gives_the_ip_adapter_rows_their_image_encoder_and_the_image_prompts_update_time(tmp_path):
    from optimum_iobinding.bench.cli import stream_rows
    from optimum_iobinding.bench.report import write_stream_report

    results = feature_results()
    rows = stream_rows(["ip-adapter", "ip-adapter-per-frame"])[len(PLAIN_ROWS) :]
    floor = {"peer": "floor", "frame_ms": 9.0, "fps": 1000 / 9.0, "unet_batch": 1, "unet_calls": 1}
    rows[0]["peers"] = {
        "ours": {"peer": "ours", "p50_ms": 11.0, "p99_ms": 12.0, "fps": 90.0, "frames": 200},
        "floor": {**floor, "parts_ms": {"vae_encoder": 2.0, "unet": 6.0, "vae_decoder": 1.0}},
    }
    rows[1]["peers"] = {
        "ours": {
            "peer": "ours",
            "p50_ms": 16.0,
            "p99_ms": 18.0,
            "fps": 62.5,
            "frames": 200,
            "update_image_prompt_ms": 4.0,
        },
        "floor": {
            **floor,
            "frame_ms": 12.0,
            "fps": 1000 / 12.0,
            "parts_ms": {"vae_encoder": 2.0, "image_encoder": 3.0, "unet": 6.0, "vae_decoder": 1.0},
        },
    }
    results["rows"] += rows
    write_stream_report(results, tmp_path)
    features = (tmp_path / "stream.md").read_text().split("| feature | configuration |")[1]
    label = "1 step, tiny VAE, IP-Adapter (4 image tokens, scale 1)"
    assert (
        f"| ip-adapter | {label}, fixed image prompt | floor (encoder 2.00 + UNet 1 × 6.00 at batch 1 + decoder 1.00) "
        "| 9.00 | | 111.1 | 1.00 | | |"
    ) in features
    # 11 ms against the floor's 9 (1.22); 1000/90 ms a frame against the plain row's 1000/100 (1.11)
    assert f"| ip-adapter | {label}, fixed image prompt | ours | 11.00 | 12.00 | 90.0 | 1.22 | 1.11 |  |" in features
    # the image encoder once a frame, beside the UNet's calls
    assert (
        f"| ip-adapter-per-frame | {label}, image prompt per frame | floor (encoder 2.00 + image encoder 3.00 + UNet "
        "1 × 6.00 at batch 1 + decoder 1.00) | 12.00 | | 83.3 | 1.00 | | |"
    ) in features
    assert (
        f"| ip-adapter-per-frame | {label}, image prompt per frame | ours | 16.00 | 18.00 | 62.5 | 1.33 | 1.60 |"
        in (features)
    )
    # update_image_prompt alone: 4 ms of the 16 ms a frame at 62.5 frames/s
    (update,) = [line for line in features.splitlines() if line.startswith("`update_image_prompt` alone")]
    assert update.startswith("`update_image_prompt` alone (ip-adapter-per-frame): 4.00 ms a call, mean of 200 ")
    assert update.endswith("; 25 % of ours' frame time at its frames/s.")


def test_the_floor_counts_the_image_encoder_once_a_frame_and_the_unets_parts_once_a_call(monkeypatch):
    from optimum_iobinding.bench import peers

    class Stream:
        timesteps = [999.0, 499.0]

    parts = {"vae_encoder": 2.0, "image_encoder": 3.0, "unet": 5.0, "vae_decoder": 1.0}
    models = {name: (name, {"sample": torch.zeros(1, 4, 8, 8)}) for name in parts}
    config = {"stream_batch": False, "image_prompt": "per-frame"}
    asked = []

    def floor_inputs(stream, image_encoder=False):
        asked.append(image_encoder)
        return models if image_encoder else {name: models[name] for name in parts if name != "image_encoder"}

    monkeypatch.setattr(peers, "stream_floor_inputs", floor_inputs)
    monkeypatch.setattr(peers, "graph_replay_ms", lambda model, inputs, replays: parts[model])
    per_frame = peers.prepared_stream_floor(Stream(), config)
    fixed = peers.prepared_stream_floor(Stream(), {**config, "image_prompt": "fixed"})
    assert asked == [True, False]
    # two UNet calls in turn (no stream batch): 2 + 3 + 2 × 5 + 1, and without the image encoder 2 + 2 × 5 + 1
    assert (per_frame["frame_ms"], fixed["frame_ms"]) == (16.0, 13.0) and per_frame["unet_calls"] == 2
    assert list(per_frame["parts_ms"]) == ["vae_encoder", "image_encoder", "unet", "vae_decoder"]


# -------------------------------------------------------------------------------------------- the command line
@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--scenario", "stream", "--stream-features", "rcfg-self,cfg"],
            "--stream-features: expected a comma-separated list of full-cfg, rcfg-self, rcfg-initialize, "
            "filter-still, filter-moving, controlnet, controlnet-per-frame, ip-adapter, ip-adapter-per-frame, or "
            "none, got 'rcfg-self,cfg'",
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
    monkeypatch.setattr(
        cli, "ensure_ip_adapter_export", lambda kind, dtype, export, work: work / f"{kind}-ip-adapter-{dtype}-{export}"
    )
    argv = ["--scenario", "stream", "--export-only", "--work", str(tmp_path)]
    assert cli.main(argv + (["--stream-features", features] if features else [])) == 0
    assert made == controlnet_exports
    printed = capsys.readouterr().out.split()
    assert (str(tmp_path / "turbo-controlnet1") in printed) == bool(controlnet_exports)


@pytest.mark.parametrize(
    "features, ip_adapter_exports",
    [(None, 1), ("rcfg-self,controlnet", 0), ("ip-adapter-per-frame", 1), ("ip-adapter,ip-adapter-per-frame", 1)],
)
def test_the_stream_exports_include_the_ip_adapter_one_where_an_ip_adapter_row_is_chosen(
    features, ip_adapter_exports, tmp_path, monkeypatch, capsys
):
    import optimum_iobinding.bench.cli as cli

    made = []
    monkeypatch.setattr(cli, "ensure_export", lambda kind, dtype, export, work: work / f"{kind}-{dtype}-{export}")
    monkeypatch.setattr(cli, "ensure_tiny_vae_export", lambda dtype, export, work: work / "taesd")
    monkeypatch.setattr(cli, "ensure_controlnet_export", lambda kind, dtype, export, work, count: work / "controlnet")
    monkeypatch.setattr(
        cli,
        "ensure_ip_adapter_export",
        lambda kind, dtype, export, work: made.append((kind, dtype, export, work)) or work / f"{kind}-ip-adapter",
    )
    argv = ["--scenario", "stream", "--export-only", "--work", str(tmp_path), "--dtypes", "fp32", "--exports", "plain"]
    assert cli.main(argv + (["--stream-features", features] if features else [])) == 0
    assert made == [("turbo", "fp32", "plain", tmp_path)] * ip_adapter_exports
    assert (str(tmp_path / "turbo-ip-adapter") in capsys.readouterr().out.split()) == bool(ip_adapter_exports)


# ------------------------------------------------------------------------ the rows on the tiny model, on the CPU
SIZE = 64
FRAMES = 12


@pytest.fixture(scope="module")
def tiny_exports(tmp_path_factory):
    """The tiny random model's export and its export with a random ControlNet, through the bench's export cache."""
    from optimum_iobinding.bench.zoo import ensure_controlnet_export, ensure_export

    work = tmp_path_factory.mktemp("bench-work")
    return ensure_export("tiny", "fp32", "plain", work), ensure_controlnet_export("tiny", "fp32", "plain", work)


@pytest.fixture(scope="module")
def tiny_ip_adapter_export(tiny_exports):
    """The tiny random model's export for IP-Adapter (with the tiny image encoder), beside the other two."""
    from optimum_iobinding.bench.zoo import ensure_ip_adapter_export

    return ensure_ip_adapter_export("tiny", "fp32", "plain", tiny_exports[0].parent)


def feature_folder(config, plain, with_controlnet, with_ip_adapter):
    """The export a feature row runs on, as stream_benchmark chooses it."""
    if config.get("controlnets"):
        return with_controlnet
    return with_ip_adapter if config.get("image_prompt") else plain


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
def test_each_row_prepares_and_feeds_its_feature_and_the_floor_runs_its_models(
    feature, tiny_exports, tiny_ip_adapter_export
):
    from optimum_iobinding import OnnxStreamDiffusionControlNetPipeline
    from optimum_iobinding.bench.cli import stream_config, stream_rows
    from optimum_iobinding.bench.peers import (
        control_images,
        image_prompts,
        load_stream,
        measure_stream,
        stream_floor_inputs,
    )

    plain, with_controlnet = tiny_exports
    row = next(row for row in stream_rows([feature] if feature else []) if row.get("feature") == feature)
    config = stream_config(row)
    generator = torch.Generator().manual_seed(0)
    sources = [torch.rand(3, SIZE, SIZE, generator=generator) * 2 - 1 for _ in range(8)]
    controls = control_images(config, SIZE, "cpu")
    assert len(controls) == {"controlnet": 1, "controlnet-per-frame": 8}.get(feature, 0)
    prompts = image_prompts(config, SIZE)
    assert len(prompts) == {"ip-adapter": 1, "ip-adapter-per-frame": 8}.get(feature, 0)
    stream = load_stream(
        feature_folder(config, plain, with_controlnet, tiny_ip_adapter_export),
        None,
        config,
        controls[0] if config.get("control") == "fixed" else None,
        provider="CPUExecutionProvider",
        size=SIZE,
        ip_adapter_image=prompts[0] if prompts else None,
    )
    assert isinstance(stream, OnnxStreamDiffusionControlNetPipeline) == bool(config.get("controlnets"))
    result = measure_stream(stream, config, sources, controls, FRAMES, 2, lambda: None, prompts)
    assert result["frames"] == FRAMES and len(result["latency_ms_all"]) == FRAMES and result["unet_steps"] == 1
    if feature == "filter-still":  # one frame again and again: the filter keeps one in max_skip_frame + 2 at most
        assert FRAMES - 2 <= result["skipped_frames"] < FRAMES
        assert result["skipped_share"] == result["skipped_frames"] / FRAMES
    elif feature == "filter-moving":  # every frame new: each kept
        assert result["skipped_frames"] == 0 and result["skipped_share"] == 0.0
    else:
        assert "skipped_share" not in result and stream.skipped_frames == 0
    # the time of update_image_prompt alone where each frame brings an image prompt, and only there
    assert ("update_image_prompt_ms" in result) == (feature == "ip-adapter-per-frame")

    models = stream_floor_inputs(stream, image_encoder=config.get("image_prompt") == "per-frame")
    nets = ["controlnet"] if config.get("controlnets") else []
    image_encoder = ["image_encoder"] if feature == "ip-adapter-per-frame" else []
    assert list(models) == ["vae_encoder", *image_encoder, *nets, "unet", "vae_decoder"]
    unet, unet_inputs = models["unet"]
    assert unet is stream.unet
    # the guidance's rows: a negative-prompt row beside the latent's ("full"), one for the newest frame
    # ("initialize"), none for residual guidance's "self" and without guidance
    assert unet_inputs["sample"].shape[0] == {"full-cfg": 2, "rcfg-initialize": 2}.get(feature, 1)
    assert set(unet_inputs) == set(unet.input_names)  # a ControlNet's residuals, the image prompt's inputs among them
    # an IP-Adapter row's UNet takes its 4 image-prompt tokens (the other exports take no image prompt)
    tokens = {name: value.shape[1] for name, value in unet_inputs.items() if name.startswith("ip_adapter_")}
    assert set(tokens.values()) == ({4} if config.get("image_prompt") else set())
    assert models["vae_encoder"][1]["sample"].shape == (1, 3, SIZE, SIZE)
    assert unet_inputs["sample"] is not stream.unet_inputs["sample"]  # copies: the stream's own are not written
    for model, inputs in models.values():
        assert model(**inputs)[0].shape[0] >= 1  # each runs on the inputs given


def test_the_per_frame_image_prompt_is_given_before_each_frame_and_reaches_the_unet(tiny_ip_adapter_export):
    from optimum_iobinding.bench.cli import stream_config, stream_rows
    from optimum_iobinding.bench.peers import image_prompts, load_stream, measure_stream

    generator = torch.Generator().manual_seed(0)
    sources = [torch.rand(3, SIZE, SIZE, generator=generator) * 2 - 1 for _ in range(8)]
    keys, events = {}, {}
    for feature in ("ip-adapter", "ip-adapter-per-frame"):
        config = stream_config(stream_rows([feature])[-1])
        prompts = image_prompts(config, SIZE)
        stream = load_stream(
            tiny_ip_adapter_export,
            None,
            config,
            provider="CPUExecutionProvider",
            size=SIZE,
            ip_adapter_image=prompts[0],
        )
        expected = [stream.image_prompt_inputs(prompt, None, 1, False)["ip_adapter_key_0"] for prompt in prompts]
        prepared = stream.unet_inputs["ip_adapter_key_0"].clone()
        torch.testing.assert_close(prepared, expected[0])  # prepare's image prompt, the first of them
        assert prepared.abs().max() > 0  # an image prompt: not the zeros of none
        seen = events[feature] = []
        update, call = stream.update_image_prompt, type(stream).__call__

        def spied_update(ip_adapter_image=None, seen=seen, prompts=prompts, update=update):
            seen.append(f"prompt {[id(prompt) for prompt in prompts].index(id(ip_adapter_image))}")
            return update(ip_adapter_image=ip_adapter_image)

        def spied_call(self, *args, seen=seen, call=call, **kwargs):
            seen.append("frame")
            return call(self, *args, **kwargs)

        stream.update_image_prompt = spied_update
        stream.__class__ = type("Spied", (type(stream),), {"__call__": spied_call})
        result = measure_stream(stream, config, sources, [], 3, 1, lambda seen=seen: seen.append("wait"), prompts)
        keys[feature] = (stream.unet_inputs["ip_adapter_key_0"], expected)
        assert ("update_image_prompt_ms" in result) == (feature == "ip-adapter-per-frame")
    kept, (only,) = keys["ip-adapter"]
    torch.testing.assert_close(kept, only)  # no update: prepare's image prompt for every frame
    assert not any(event.startswith("prompt") for event in events["ip-adapter"])
    # per frame: each frame after an image prompt of its own (the prompts in turn), in the warm-up, the latency run
    # (each frame waited for) and the frames/s run (waited for at the end); then update_image_prompt alone
    warmup = ["prompt 0", "frame"]
    latency = ["prompt 0", "frame", "wait", "prompt 1", "frame", "wait", "prompt 2", "frame", "wait"]
    back_to_back = ["wait", "prompt 0", "frame", "prompt 1", "frame", "prompt 2", "frame", "wait"]
    alone = ["prompt 0", "wait", "prompt 1", "wait", "prompt 2", "wait"]
    assert events["ip-adapter-per-frame"] == warmup + latency + back_to_back + alone
    last, expected = keys["ip-adapter-per-frame"]
    torch.testing.assert_close(last, expected[2])  # the last image prompt given is the UNet's
    assert not torch.allclose(last, expected[0]) and len(expected) == 8


def test_the_ip_adapter_export_is_the_models_with_an_image_encoder_made_once(
    tiny_exports, tiny_ip_adapter_export, monkeypatch
):
    import optimum_iobinding.export as export
    from optimum_iobinding import OnnxStreamDiffusionPipeline
    from optimum_iobinding.bench.peers import random_ip_adapter_for
    from optimum_iobinding.bench.zoo import IP_ADAPTER_TOKENS, ensure_ip_adapter_export
    from optimum_iobinding.errors import ArgumentError

    plain, _ = tiny_exports
    folder = tiny_ip_adapter_export
    assert folder.name == "tiny-ip-adapter-fp32-plain" and folder.parent == plain.parent
    assert (folder / "image_encoder" / "model.onnx").is_file() and not (plain / "image_encoder").exists()
    stream = OnnxStreamDiffusionPipeline.from_pretrained(folder, provider="CPUExecutionProvider")
    assert len(stream.image_prompt_layers) == 4  # the tiny UNet's cross-attention layers
    without = OnnxStreamDiffusionPipeline.from_pretrained(plain, provider="CPUExecutionProvider")
    assert without.image_prompt_layers == []
    with pytest.raises(
        ArgumentError, match=r"pipe: expected a UNet exported for IP-Adapter .*got image-prompt widths \[\]"
    ):
        random_ip_adapter_for(without)
    # the random adapter: its projection from the tiny image encoder's image_embeds (16 wide) to 4 tokens of the
    # UNet's cross-attention width (32), each layer's keys and values from those tokens to the layer's width (64)
    state = random_ip_adapter_for(stream)
    assert stream.image_encoder.config["projection_dim"] == 16
    assert state["image_proj"]["proj.weight"].shape == (IP_ADAPTER_TOKENS * 32, 16)
    assert state["image_proj"]["norm.weight"].shape == (32,)
    assert sorted(state["ip_adapter"]) == sorted(f"{i}.to_{kv}_ip.weight" for i in (1, 3, 5, 7) for kv in "kv")
    assert {tuple(weight.shape) for weight in state["ip_adapter"].values()} == {(64, 32)}
    stream.load_ip_adapter(state)  # as load_ip_adapter takes it, its projection diffusers' ImageProjection
    assert stream._ip_adapter.projection.image_embeds.in_features == 16

    def no_export(*args, **kwargs):
        raise AssertionError("exported again")

    monkeypatch.setattr(export, "export_pipeline", no_export)
    assert ensure_ip_adapter_export("tiny", "fp32", "plain", plain.parent) == folder


def test_the_random_adapter_projects_the_image_embeds_to_the_cross_attention_width():
    from optimum_iobinding.bench.zoo import random_ip_adapter_state_dict

    state = random_ip_adapter_state_dict([320, 640, 1280], 1024, 768, seed=3)
    assert state["image_proj"]["proj.weight"].shape == (4 * 1024, 768)
    assert state["image_proj"]["proj.bias"].shape == (4 * 1024,)
    assert [tuple(state["ip_adapter"][f"{i}.to_v_ip.weight"].shape) for i in (1, 3, 5)] == [
        (320, 1024),
        (640, 1024),
        (1280, 1024),
    ]
    again = random_ip_adapter_state_dict([320, 640, 1280], 1024, 768, seed=3)
    assert torch.equal(state["ip_adapter"]["5.to_k_ip.weight"], again["ip_adapter"]["5.to_k_ip.weight"])
    other = random_ip_adapter_state_dict([320, 640, 1280], 1024, 768, seed=4)
    assert not torch.equal(state["ip_adapter"]["5.to_k_ip.weight"], other["ip_adapter"]["5.to_k_ip.weight"])


def test_the_turbo_ip_adapter_export_has_an_image_encoder_of_vit_h_shape():
    from optimum_iobinding.bench.zoo import build_ip_adapter_image_encoder

    with torch.device("meta"):  # its shape alone: no weights made
        encoder = build_ip_adapter_image_encoder("turbo")
    config = encoder.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (1280, 32, 16)
    assert (config.patch_size, config.image_size, config.projection_dim, config.intermediate_size) == (
        14,
        224,
        1024,
        5120,
    )
    assert sum(parameter.numel() for parameter in encoder.parameters()) == 632_076_800  # ViT-H/14's vision tower


@pytest.mark.parametrize("kind", ["sdxl", "lcm"])
def test_an_ip_adapter_export_is_refused_for_models_without_one_before_any_work(kind, tmp_path):
    from optimum_iobinding.bench.zoo import ensure_ip_adapter_export
    from optimum_iobinding.errors import ArgumentError

    with pytest.raises(
        ArgumentError, match=f"kind: expected one of tiny, small, sd15, turbo for an IP-Adapter, got '{kind}'"
    ):
        ensure_ip_adapter_export(kind, "fp16", "optimized", tmp_path)
    assert list(tmp_path.iterdir()) == []  # not even a lock file


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and onnxruntime-gpu")
def test_on_the_gpu_each_feature_row_is_measured_by_ours_and_the_floor_of_its_prepared_models(tmp_path):
    from optimum_iobinding.bench.cli import stream_config, stream_rows
    from optimum_iobinding.bench.peers import run_stream_peer
    from optimum_iobinding.bench.zoo import (
        ensure_controlnet_export,
        ensure_export,
        ensure_ip_adapter_export,
        ensure_tiny_vae_export,
    )

    work = tmp_path / "work"
    plain = ensure_export("tiny", "fp16", "optimized", work)
    with_controlnet = ensure_controlnet_export("tiny", "fp16", "optimized", work)
    with_ip_adapter = ensure_ip_adapter_export("tiny", "fp16", "optimized", work)
    taesd = ensure_tiny_vae_export("fp16", "optimized", work)
    for row in stream_rows(FEATURES)[len(PLAIN_ROWS) :]:
        feature, config = row["feature"], stream_config(row)
        folder = feature_folder(config, plain, with_controlnet, with_ip_adapter)
        ours = run_stream_peer("ours", folder, taesd, config, 24, 3, work)
        floor = run_stream_peer("floor", folder, taesd, config, 24, 3, work)
        assert ours["frames"] == 24 and len(ours["latency_ms_all"]) == 24 and ours["unet_steps"] == 1, feature
        assert floor["unet_batch"] == {"full-cfg": 2, "rcfg-initialize": 2}.get(feature, 1), feature
        nets = ["controlnet"] if config.get("controlnets") else []
        image_encoder = ["image_encoder"] if config.get("image_prompt") == "per-frame" else []
        assert list(floor["parts_ms"]) == ["vae_encoder", *image_encoder, *nets, "unet", "vae_decoder"], feature
        assert floor["frame_ms"] == pytest.approx(sum(floor["parts_ms"].values())) and floor["unet_calls"] == 1
        assert ("update_image_prompt_ms" in ours) == (feature == "ip-adapter-per-frame"), feature
        if feature == "ip-adapter-per-frame":
            assert ours["update_image_prompt_ms"] > 0
        if feature == "filter-still":
            assert 20 <= ours["skipped_frames"] < 24 and ours["skipped_share"] == ours["skipped_frames"] / 24
        elif feature == "filter-moving":
            assert ours["skipped_frames"] == 0
        else:
            assert "skipped_share" not in ours, feature
