"""The command line speaks plainly: one line ``optimum-iobinding: error: …``, exit status 2 for a mistake in what was
asked (checked before any work), 1 for a failure while doing it, a traceback only with ``--debug``."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
from PIL import Image
import pytest
import torch

import optimum_iobinding
import optimum_iobinding.pipelines  # noqa: F401 (here, not in a test: its libraries' import notices are no test's)
from optimum_iobinding import cli
from optimum_iobinding.cli import main
from tests.commands import error_line


@pytest.mark.parametrize(
    "out, message",
    [
        ("{tmp}", r"--out: expected an image file name, got the folder"),
        ("{tmp}/picture", r"--out: expected a file name with an image extension PIL can write \(.*\.png.*\), got"),
        ("{tmp}/picture.txt", r"--out: expected a file name with an image extension PIL can write"),
        ("{tmp}/file.png/x.png", r"--out: expected a writable folder for .* is not a folder"),
    ],
)
def test_a_bad_out_is_refused_before_any_work(tmp_path, capsys, no_work, out, message):
    (tmp_path / "file.png").write_bytes(b"")
    assert main(["generate", "--out", out.format(tmp=tmp_path)]) == 2
    import re

    line = error_line(capsys)
    assert line.startswith("optimum-iobinding: error: ") and re.search(message, line), line


@pytest.mark.parametrize("model", ["./models/sd15-onnx", "../nowhere/at/all", "/no/such/folder"])
def test_a_missing_local_model_is_reported_as_missing(capsys, no_work, model):
    assert main(["generate", "--model", model]) == 2
    assert (
        f"--model: expected an existing local folder or a hub repository id, got {model!r}: no such file or "
        "folder" in error_line(capsys)
    )


@pytest.mark.parametrize("flag", ["--steps", "--height", "--width"])
def test_sizes_and_steps_must_be_positive(capsys, no_work, flag):
    assert main(["generate", flag, "0"]) == 2
    assert f"{flag}: expected a positive integer, got 0" in error_line(capsys)


def test_export_into_a_non_empty_folder_is_refused_before_exporting(tmp_path, capsys, no_work):
    (tmp_path / "mine.txt").write_text("mine")
    assert main(["export", "--tiny-random", "--output", str(tmp_path)]) == 2
    line = error_line(capsys)
    assert "--output: expected a new or empty folder" in line
    assert "pass --overwrite to replace it" in line and "overwrite=True" not in line  # the command's own words
    assert (tmp_path / "mine.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "output, message",
    [
        (".", "--output: expected a folder apart from the working folder '{cwd}', got '.', which is it"),
        ("", "--output: expected a folder apart from the working folder '{cwd}', got '', which is it"),
        ("..", "--output: expected a folder apart from the working folder '{cwd}', got '..', which holds it"),
        (
            "/sys/optimum-iobinding-out",
            "--output: expected a folder that can be written, got '/sys/optimum-iobinding-out'",
        ),
    ],
    ids=["dot", "empty", "parent", "sys"],
)
def test_export_refuses_an_output_it_cannot_replace_or_make_before_exporting(
    tmp_path, monkeypatch, capsys, no_work, output, message
):
    """With --overwrite too: the working folder (or one holding it) is not replaced, and a folder that takes no new
    folder (/sys, a read-only mount) is a mistake in --output (status 2), found before the export's work."""
    if output.startswith("/sys") and not os.path.isdir("/sys"):
        pytest.skip("no /sys here")
    work = tmp_path / "work"
    work.mkdir()
    (work / "mine.txt").write_text("mine")
    monkeypatch.chdir(work)
    assert main(["export", "--tiny-random", "--output", output, "--overwrite"]) == 2
    assert message.format(cwd=work.resolve()) in error_line(capsys)
    assert sorted(os.listdir(work)) == ["mine.txt"] and sorted(os.listdir(tmp_path)) == ["work"]


def test_sigterm_during_an_export_leaves_no_partial_folder_and_exits_143(tmp_path, monkeypatch, capsys):
    """A ``kill`` (SIGTERM) ends the export as Ctrl-C does: its temporary folder is removed, the handler before is
    put back."""
    import signal

    import optimum_iobinding.export.unet as unet_export

    exported = []
    export_component = unet_export.export_component

    def terminated_at_the_second(*args, **kwargs):
        if exported:
            signal.raise_signal(signal.SIGTERM)
        exported.append(args[0])
        return export_component(*args, **kwargs)

    monkeypatch.setattr(unet_export, "export_component", terminated_at_the_second)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["export", "--tiny-random", "--output", str(tmp_path / "out")]) == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == "optimum-iobinding: terminated"
    assert os.listdir(tmp_path) == []  # neither the output nor its temporary folder
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.fixture(scope="module")
def torch_folder(tmp_path_factory):
    """A diffusers (torch) tiny pipeline folder, and an ONNX component folder, as users pass to --vae and the like."""
    from optimum_iobinding.export.tiny import build_tiny_random_pipeline

    folder = tmp_path_factory.mktemp("torch") / "sd"
    build_tiny_random_pipeline().save_pretrained(folder)
    (folder / "onnx-vae").mkdir()
    (folder / "onnx-vae" / "model.onnx").write_bytes(b"")
    (folder / "taesd").mkdir()
    (folder / "taesd" / "config.json").write_text('{"_class_name": "AutoencoderTiny"}')
    return folder


@pytest.mark.parametrize(
    "option, name, message",
    [
        (
            "--vae",
            "unet",
            "--vae: expected a VAE (diffusers' AutoencoderKL), got '{}', whose config.json names UNet2DConditionModel",
        ),
        (
            "--vae",
            "taesd",
            "--vae: expected a VAE (diffusers' AutoencoderKL), got '{}', whose config.json names AutoencoderTiny; "
            "AutoencoderTiny goes in --tiny-vae",
        ),
        (
            "--vae",
            "onnx-vae",
            "--vae: expected the torch weights of a VAE (diffusers' AutoencoderKL) to export, got '{}', an ONNX export",
        ),
        (
            "--vae",
            "model_index.json",
            "--vae: expected a folder or hub id of a VAE (diffusers' AutoencoderKL), got the file '{}'",
        ),
        (
            "--vae",
            "scheduler",
            "--vae: expected a folder of a VAE (diffusers' AutoencoderKL) holding config.json, got "
            "'{}', which has none",
        ),
        (
            "--controlnet",
            "vae",
            "--controlnet: expected a ControlNet (diffusers' ControlNetModel), got '{}', whose "
            "config.json names AutoencoderKL; AutoencoderKL goes in --vae",
        ),
    ],
    ids=["unet-as-vae", "tiny-vae-as-vae", "onnx", "file", "no-config", "vae-as-controlnet"],
)
def test_export_refuses_a_component_folder_of_another_kind_naming_the_option(
    torch_folder, tmp_path, capsys, no_work, option, name, message
):
    path = str(torch_folder / name)
    assert main(["export", "--tiny-random", option, path, "--output", str(tmp_path / "out")]) == 2
    assert error_line(capsys) == f"optimum-iobinding: error: {message.format(path)}"
    assert not (tmp_path / "out").exists()


def test_export_overwrite_refuses_an_output_holding_a_folder_it_reads(torch_folder, tmp_path, capsys, no_work):
    """``--overwrite`` replaces --output whole: a --vae inside it would be deleted by the export reading it."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(torch_folder / "vae", out / "my-vae")
    assert main(["export", "--tiny-random", "--vae", str(out / "my-vae"), "--output", str(out), "--overwrite"]) == 2
    assert error_line(capsys) == (
        f"optimum-iobinding: error: --output: expected a path apart from --vae ({str(out / 'my-vae')!r}), got "
        f"{str(out)!r}, which holds it: writing --output would replace what --vae reads"
    )
    assert (out / "my-vae" / "config.json").is_file()


def test_export_without_a_model_is_a_usage_error(tmp_path, capsys, no_work):
    assert main(["export", "--output", str(tmp_path / "x")]) == 2
    assert "export: give a model folder or hub id, or --tiny-random" in error_line(capsys)


@pytest.mark.parametrize(
    "command",
    [[], ["generate"], ["export"], ["serve"], ["loadtest"], ["bench"]],
    ids=["top", "generate", "export", "serve", "loadtest", "bench"],
)
def test_every_command_prints_its_help_and_exits_0(capsys, no_work, command):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: optimum-iobinding")


def test_argparse_mistakes_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--steps", "many"])
    assert exit_info.value.code == 2
    assert "invalid int value: 'many'" in capsys.readouterr().err


@pytest.fixture
def failing_work(monkeypatch):
    """The command fails once it starts working (after its arguments passed their checks)."""

    def failing(*args, **kwargs):
        raise RuntimeError("the GPU caught fire")

    monkeypatch.setattr(cli, "tiny_model_folder", failing)


def test_a_failure_while_working_exits_1_in_one_line(tmp_path, capsys, failing_work):
    assert main(["generate", "--out", str(tmp_path / "a.png")]) == 1
    assert error_line(capsys) == "optimum-iobinding: error: the GPU caught fire"


def test_debug_shows_the_traceback_of_a_failure(tmp_path, failing_work):
    with pytest.raises(RuntimeError, match="caught fire"):
        main(["--debug", "generate", "--out", str(tmp_path / "a.png")])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where there is no CUDA GPU")
def test_bench_without_a_gpu_exits_2_saying_why_in_one_line(tmp_path, capsys):
    """What the machine cannot do, known before any work, is answered as a mistake is (README: status 2)."""
    assert main(["bench", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]) == 2
    assert error_line(capsys).startswith("optimum-iobinding: error: no CUDA GPU is visible to torch here")
    assert not (tmp_path / "work").exists()  # nothing exported or written first


# ------------------------------------------------------------------------------------------------------ --debug
@pytest.mark.parametrize(
    "argv",
    [
        ["--debug", "generate", "--out", "{out}"],
        ["generate", "--debug", "--out", "{out}"],
        ["generate", "a cat", "--out", "{out}", "--debug"],
    ],
    ids=["before the command", "after the command", "last"],
)
def test_debug_works_after_the_subcommand(tmp_path, failing_work, argv):
    with pytest.raises(RuntimeError, match="caught fire"):
        main([arg.format(out=tmp_path / "a.png") for arg in argv])


@pytest.fixture
def bench_calls(monkeypatch):
    """The arguments ``bench`` was given, where its run fails."""
    import optimum_iobinding.bench.cli as bench_cli

    calls = []

    def failing_bench(argv):
        calls.append(argv)
        raise RuntimeError("no GPU in the test")

    monkeypatch.setattr(bench_cli, "main", failing_bench)
    return calls


@pytest.mark.parametrize(
    "argv", [["--debug", "bench", "--runs", "2"], ["bench", "--runs", "2", "--debug"]], ids=["before", "after"]
)
def test_debug_works_around_bench_and_is_not_passed_to_it(bench_calls, argv):
    with pytest.raises(RuntimeError, match="no GPU in the test"):
        main(argv)
    assert bench_calls == [["--runs", "2"]]


def test_a_bench_failure_is_one_line_without_debug(bench_calls, capsys):
    assert main(["bench", "--runs", "2"]) == 1
    assert error_line(capsys) == "optimum-iobinding: error: no GPU in the test"


# ------------------------------------------------------------------------------------------------ abbreviations
@pytest.mark.parametrize(
    "argv, unknown",
    [
        (["generate", "--step", "2"], "--step"),
        (["generate", "--guid", "2"], "--guid"),
        (["serve", "--replica", "2"], "--replica"),
        (["loadtest", "http://127.0.0.1:8000", "--concurren", "2"], "--concurren"),
        (["export", "--tiny-random", "--output", "x", "--opt", "cpu"], "--opt"),
        (["--deb", "generate"], "--deb"),
    ],
    ids=["generate", "generate-float", "serve", "loadtest", "export", "top"],
)
def test_an_abbreviated_option_is_refused_by_name(capsys, no_work, argv, unknown):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert f"unrecognized arguments: {unknown}" in capsys.readouterr().err


# ------------------------------------------------------------------------------ numbers, before the model loads
@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_a_negative_seed_is_refused_before_the_model_loads(capsys, no_work, seed):
    assert main(["generate", "--seed", seed]) == 2
    assert error_line(capsys) == (
        f"optimum-iobinding: error: --seed: expected an integer in 0 … 4294967295 (numpy's seeds), got {seed}"
    )


def test_the_largest_numpy_seed_is_accepted(tmp_path, failing_work):
    assert main(["generate", "--seed", str(2**32 - 1), "--out", str(tmp_path / "a.png")]) == 1  # got to work


@pytest.mark.parametrize("guidance", ["nan", "inf", "-inf"])
def test_guidance_must_be_a_finite_number(capsys, no_work, guidance):
    assert main(["generate", f"--guidance={guidance}"]) == 2
    assert error_line(capsys) == f"optimum-iobinding: error: --guidance: expected a finite number, got {guidance}"


def test_a_provider_this_onnxruntime_lacks_is_refused_before_the_model_loads(capsys, no_work):
    assert main(["generate", "--provider", "NoSuchExecutionProvider"]) == 2
    assert error_line(capsys).startswith(
        "optimum-iobinding: error: --provider: 'NoSuchExecutionProvider' is not available in this onnxruntime build"
    )


def test_a_size_the_model_cannot_run_is_refused_naming_height_and_width(tiny_folder, tmp_path, capsys):
    """Which sizes a UNet runs depends on the model: the pipeline checks them before its first step, and the
    command names its own options."""
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_folder),
                "--height",
                "100",
                "--width",
                "64",
                "--steps",
                "1",
                "--provider",
                "CPUExecutionProvider",
                "--out",
                str(tmp_path / "a.png"),
            ]
        )
        == 2
    )
    assert error_line(capsys).startswith("optimum-iobinding: error: --height and --width: expected multiples of ")
    assert not (tmp_path / "a.png").exists()


SERVE_MISTAKES = [
    (["--replicas", "0"], "--replicas: expected a positive integer, got 0"),
    (["--max-batch-size", "0"], "--max-batch-size: expected a positive integer, got 0"),
    (["--batch-wait-ms", "-1"], "--batch-wait-ms: expected milliseconds in 0 … 60000, got -1.0"),
    (["--batch-wait-ms", "nan"], "--batch-wait-ms: expected milliseconds in 0 … 60000, got nan"),
    (["--port", "0"], "--port: expected a port in 1 … 65535, got 0"),
    (["--port", "65536"], "--port: expected a port in 1 … 65535, got 65536"),
    (["--steps", "0"], "--steps: expected a positive integer, got 0"),
    (["--guidance", "nan"], "--guidance: expected a finite number, got nan"),
    (["--warmup-batch-sizes", "1,x"], "--warmup-batch-sizes: expected an integer, got 'x'"),
    (["--warmup-batch-sizes", "1,0"], "--warmup-batch-sizes: expected a list of positive integers, got [1, 0]"),
    (["--max-queued-requests", "0"], "--max-queued-requests: expected a positive integer, got 0"),
    (["--png-compression", "10"], "--png-compression: expected a zlib level 0–9, got 10"),
    (["--max-steps", "0"], "--max-steps: expected a positive integer, got 0"),
    (["--max-prompt-chars", "0"], "--max-prompt-chars: expected a positive integer, got 0"),
]


@pytest.mark.parametrize("argv, message", SERVE_MISTAKES, ids=[" ".join(argv) for argv, _ in SERVE_MISTAKES])
def test_serve_refuses_each_setting_by_its_option_before_building_anything(capsys, no_work, argv, message):
    assert main(["serve", *argv]) == 2
    assert error_line(capsys) == f"optimum-iobinding: error: {message}"


@pytest.mark.parametrize("opset", [12, 13, 21, 22])
def test_export_refuses_the_opsets_the_exporter_refuses_before_exporting(tmp_path, capsys, no_work, opset):
    assert main(["export", "--tiny-random", "--opset", str(opset), "--output", str(tmp_path / "out")]) == 2
    assert (
        error_line(capsys) == f"optimum-iobinding: error: --opset: expected an integer in 14 … 20 (17 is "
        f"tested), got {opset}"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("opset", [12, 13, 21, 22])
def test_the_exporter_refuses_the_same_opsets(tmp_path, opset):
    from optimum_iobinding.export import export_pipeline

    with pytest.raises(ValueError, match=r"opset: expected an integer in \[14, 20\]"):
        export_pipeline(None, tmp_path / "out", tiny_random=True, opset=opset, progress=False)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--image-encoder", "enc"],
            "--image-encoder: expected it with --ip-adapter (the IP-Adapter's image encoder), got it alone",
        ),
        (
            ["--ip-adapter", "--step-cache"],
            "--ip-adapter: expected it without --step-cache (DeepCache's parts take no image prompt)",
        ),
    ],
    ids=["image-encoder-alone", "ip-adapter-with-step-cache"],
)
def test_export_refuses_ip_adapter_options_that_do_not_go_together_in_its_words(
    tmp_path, capsys, no_work, argv, message
):
    assert main(["export", "--tiny-random", *argv, "--output", str(tmp_path / "out")]) == 2
    assert error_line(capsys) == f"optimum-iobinding: error: {message}"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_export_refuses_fp16_with_another_dtype_naming_both_options_before_exporting(tmp_path, capsys, no_work, dtype):
    assert main(["export", "--tiny-random", "sd3", "--fp16", "--dtype", dtype, "--output", str(tmp_path / "out")]) == 2
    assert error_line(capsys) == (
        f"optimum-iobinding: error: --fp16 and --dtype: expected one precision, got --fp16 "
        f"(an alias of --dtype fp16) and --dtype {dtype}; give --dtype alone"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv, what",
    [
        (["--tiny-random", "sd"], "the tiny random sd pipeline (a UNet)"),
        (["--tiny-random", "xl"], "the tiny random xl pipeline (a UNet)"),
        (["--tiny-vae"], "a VAE alone"),
    ],
    ids=["sd", "xl", "vae-alone"],
)
def test_export_refuses_dtype_bf16_for_a_unet_pipeline_naming_dtype_before_exporting(
    tmp_path, capsys, no_work, argv, what
):
    assert main(["export", *argv, "--dtype", "bf16", "--output", str(tmp_path / "out")]) == 2
    assert error_line(capsys) == (
        f"optimum-iobinding: error: --dtype: expected 'fp32' or 'fp16' for {what}, got 'bf16'; hint: bf16 is for "
        "Stable Diffusion 3/3.5 and FLUX.1 (on a UNet most ops would stay float32, without a bfloat16 CUDA kernel: "
        "Conv below opset 22, GroupNorm, NhwcConv, BiasSplitGelu)"
    )
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_vae_dtype_for_a_family_whose_vae_follows_dtype_naming_the_option(tmp_path, capsys):
    assert main(["export", "--tiny-random", "sd", "--vae-dtype", "fp16", "--output", str(tmp_path / "out")]) == 2
    assert error_line(capsys) == (
        "optimum-iobinding: error: --vae-dtype: expected none for a StableDiffusionPipeline (its VAE follows the "
        "export's precision; only Wan's VAE has one of its own), got 'fp16'"
    )
    assert not (tmp_path / "out").exists()


def test_export_takes_only_the_dtypes_it_exports(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--tiny-random", "sd3", "--dtype", "int8", "--output", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert error_line(capsys).startswith("optimum-iobinding: error: --dtype: invalid choice: 'int8'")


@pytest.mark.parametrize(
    "argv, dtype",
    [
        ([], "fp32"),
        (["--fp16"], "fp16"),
        (["--dtype", "fp16"], "fp16"),
        (["--fp16", "--dtype", "fp16"], "fp16"),
        (["--dtype", "bf16"], "bf16"),
    ],
    ids=["default", "fp16-alias", "fp16", "both-fp16", "bf16"],
)
def test_export_hands_its_dtype_to_the_exporter_and_says_it(tmp_path, capsys, monkeypatch, argv, dtype):
    import optimum_iobinding.export as export

    calls = []

    def exporter(model, output_dir, **kwargs):
        calls.append(kwargs)
        return Path(output_dir)

    monkeypatch.setattr(export, "export_pipeline", exporter)
    assert main(["export", "--tiny-random", "flux", *argv, "--output", str(tmp_path / "out")]) == 0
    assert [(call["dtype"], call.get("fp16", False)) for call in calls] == [(dtype, False)]
    assert f"({dtype}, opset 17)" in capsys.readouterr().out


def test_export_refuses_a_model_and_tiny_random_together(tmp_path, capsys, no_work):
    assert main(["export", "some/model", "--tiny-random", "--output", str(tmp_path / "out")]) == 2
    assert error_line(capsys) == (
        "optimum-iobinding: error: model: expected a model folder or hub id, or "
        "--tiny-random, got both ('some/model' and --tiny-random sd)"
    )


# ------------------------------------------------------------------------------ a hub id that cannot be had
@pytest.fixture
def offline_hub(monkeypatch):
    """The Hugging Face Hub cannot be reached: every download fails as huggingface_hub's own offline error."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def unreachable(repo_id, **kwargs):
        raise LocalEntryNotFoundError("the Hub cannot be reached from this test")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)


def test_a_hub_id_that_cannot_be_fetched_names_model(tmp_path, capsys, offline_hub):
    assert main(["generate", "--model", "nobody/nothing-here", "--out", str(tmp_path / "a.png")]) == 2
    assert error_line(capsys) == (
        "optimum-iobinding: error: --model: 'nobody/nothing-here' is not a local folder (no such path here), and the "
        "Hugging Face Hub could not provide it: LocalEntryNotFoundError: the Hub cannot be reached from this test"
    )


@pytest.mark.parametrize(
    "argv, option",
    [
        (["nobody/nothing-here"], "model"),
        (["--tiny-random", "--vae", "nobody/some-vae"], "--vae"),
        (["--tiny-random", "--controlnet", "nobody/some-controlnet"], "--controlnet"),
        (["--tiny-random", "flux-dev", "--controlnet", "nobody/some-controlnet"], "--controlnet"),
    ],
    ids=["model", "vae", "controlnet", "flux-controlnet"],
)
def test_export_of_a_hub_id_that_cannot_be_fetched_names_it_before_exporting(
    tmp_path, capsys, no_work, offline_hub, argv, option
):
    assert main(["export", *argv, "--output", str(tmp_path / "out")]) == 2
    line = error_line(capsys)
    assert line.startswith(f"optimum-iobinding: error: {option}: '") and "Hub could not provide it" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "kind, family, option",
    [
        (kind, family, option)
        for kind, family in [("flux", "FLUX.1"), ("sd3", "Stable Diffusion 3")]
        for option in ["--vae", "--controlnet", "--tiny-vae"]
        if (kind, option) != ("flux", "--controlnet")  # FLUX.1's ControlNet family takes one
    ],
)
def test_export_refuses_a_vae_or_controlnet_for_a_transformer_pipeline_before_fetching_it(
    tmp_path, capsys, no_work, offline_hub, kind, family, option
):
    argv = ["export", "--tiny-random", kind, option, "nobody/some-model", "--output", str(tmp_path / "out")]
    assert main(argv) == 2
    assert error_line(capsys) == (
        f"optimum-iobinding: error: {option}: expected none for a {family} pipeline (its export writes its own VAE "
        "and no ControlNet), got 'nobody/some-model'"
    )
    assert not (tmp_path / "out").exists()


def test_serve_of_a_hub_id_that_cannot_be_fetched_names_it_before_starting_ray(capsys, no_work, offline_hub):
    pytest.importorskip("ray.serve")
    assert main(["serve", "nobody/nothing-here"]) == 2
    assert error_line(capsys).startswith(
        "optimum-iobinding: error: model: 'nobody/nothing-here' is not a local "
        "folder (no such path here), and the Hugging Face Hub could not provide it"
    )


@pytest.mark.parametrize("stopped, status", [("SIGINT", 130), ("SIGTERM", 0), (None, 0)])
def test_serve_hands_its_limits_to_the_service_and_exits_by_the_signal_that_stopped_it(
    tmp_path, monkeypatch, tiny_folder, stopped, status
):
    pytest.importorskip("ray.serve")
    import signal

    import socket

    import optimum_iobinding.serve as serve

    with socket.socket() as probe:  # a port nothing listens on (the command refuses a busy one)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = {}

    def run(config, **kwargs):  # what the service would be started with; it stops at once, as by the signal
        started.update(config=config, **kwargs)
        return getattr(signal, stopped) if stopped else None

    monkeypatch.setattr(serve, "run", run)
    assert (
        main(
            [
                "serve",
                str(tiny_folder),
                "--max-steps",
                "60",
                "--max-prompt-chars",
                "500",
                "--max-pixels-per-image",
                "262144",
                "--request-timeout-s",
                "30",
                "--dashboard",
                "--port",
                str(port),
            ]
        )
        == status
    )
    config = started["config"]
    assert (config.max_steps, config.max_prompt_chars, config.max_pixels_per_image, config.request_timeout_s) == (
        60,
        500,
        262144,
        30.0,
    )
    assert started["dashboard"] is True and started["port"] == port


# ------------------------------------------------------------------------------------------ what a command imports
PIPELINE_LIBRARIES = ("diffusers", "transformers", "onnxruntime", "torch", "ray")
REPOSITORY = Path(cli.__file__).resolve().parents[1]


def libraries_loaded_by(code: str) -> list:
    """The pipeline libraries in ``sys.modules`` after ``code`` ran in a fresh interpreter (this checkout's package)."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {PIPELINE_LIBRARIES!r} if m in sys.modules]))"
    completed = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPOSITORY, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_importing_the_package_loads_no_pipeline_library():
    assert libraries_loaded_by("import optimum_iobinding; optimum_iobinding.__version__") == []


def test_rendering_the_bench_reports_again_loads_no_pipeline_library(tmp_path):
    (tmp_path / "coldstart.json").write_text(json.dumps({"environment": {}, "scenario": "coldstart", "rows": []}))
    code = f"from optimum_iobinding.bench.cli import main; main(['--report-only', '--out', {str(tmp_path)!r}])"
    assert libraries_loaded_by(code) == []


def test_importing_a_pipeline_class_is_quiet_and_leaves_kontext_for_later():
    """The README's ``from optimum_iobinding import OnnxStableDiffusionPipeline`` printed transformers' two "requires
    torchvision" warnings where torchvision is not installed: diffusers' FLUX.1 Kontext module, imported for its
    resolutions, imports transformers' image processors. It is imported when a reference image is first resized."""
    kontext = "diffusers.pipelines.flux.pipeline_flux_kontext"
    probe = (
        "import sys\nfrom optimum_iobinding import OnnxStableDiffusionPipeline, OnnxFluxKontextPipeline\n"
        f"print({kontext!r} in sys.modules)"
    )
    completed = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPOSITORY, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "False" and completed.stderr == ""
    from optimum_iobinding.pipelines.flux_kontext import preferred_resolutions

    diffusers_kontext = importlib.import_module(kontext)
    assert preferred_resolutions() == list(diffusers_kontext.PREFERRED_KONTEXT_RESOLUTIONS)


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["generate", "--help"],
        ["stream", "--help"],
        ["serve", "--help"],
        ["export", "--help"],
        ["loadtest", "--help"],
        ["bench", "--help"],
        ["no-such-command"],
        ["generate", "--steps", "-1"],
        ["generate", "--seed", "-1"],
        ["serve", "--port", "x"],
        ["serve", "--port", "0"],
        ["serve", "--replicas", "0"],
        ["export", "--tiny-random", "--opset", "6", "--output", "unused"],
        ["export", "--output", "unused"],
        ["stream", "in", "out", "--prompt", "a cat", "--steps", "0"],
        ["stream", "in", "out", "--prompt", "a cat", "--size", "big"],
        ["loadtest", "http://127.0.0.1:1", "--requests", "0"],
        ["generate", "--stpes", "4"],
        ["serve", "--replica", "2"],
        ["generate", "--scheduler", "eulr"],
        ["stream", "in", "out", "--prompt", "a cat", "--strenght", "0.5"],
    ],
    ids=lambda argv: " ".join(argv),
)
def test_help_and_argument_mistakes_load_no_pipeline_library(argv):
    """--help and each mistake in the arguments are answered before diffusers, transformers, onnxruntime, torch or
    Ray is imported (each takes seconds to import)."""
    code = (
        "import contextlib, io\nfrom optimum_iobinding.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "    try:\n"
        f"        status = main({argv!r})\n"
        "    except SystemExit as exit:\n"
        "        status = exit.code\n"
        "assert status in (0, 2), status"
    )
    assert libraries_loaded_by(code) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--provider", "cuda"],
        ["stream", "in", "out", "--prompt", "a cat", "--provider", "CUDAExecutionProvder"],
    ],
    ids=lambda argv: " ".join(argv),
)
def test_a_provider_mistake_is_answered_with_onnxruntime_alone(argv):
    """Which providers exist is onnxruntime's to say: the check imports it, and none of the other libraries."""
    code = (
        "import contextlib, io\nfrom optimum_iobinding.cli import main\n"
        "with contextlib.redirect_stderr(io.StringIO()) as err:\n"
        f"    status = main({argv!r})\n"
        "assert status == 2 and 'did you mean CUDAExecutionProvider?' in err.getvalue(), err.getvalue()"
    )
    assert libraries_loaded_by(code) == ["onnxruntime"]


@pytest.mark.parametrize("name", optimum_iobinding.__all__)
def test_every_public_name_is_importable_from_the_package(name):
    namespace = {}
    exec(f"from optimum_iobinding import {name}", namespace)  # the statement users write
    assert namespace[name] is getattr(optimum_iobinding, name)
    assert name in dir(optimum_iobinding)


def test_an_unknown_name_of_the_package_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchPipeline'"):
        optimum_iobinding.NoSuchPipeline  # noqa: B018


# ------------------------------------------------------------------------------- a library's names, the command's
def test_a_refused_argument_in_the_table_is_named_by_its_option_with_the_same_reason():
    from optimum_iobinding.errors import ArgumentTypeError

    refusal = ArgumentTypeError("num_inference_steps", "expected a positive integer, got 0")
    with pytest.raises(cli.UsageError) as raised:
        with cli.options_named({"num_inference_steps": "--steps"}):
            raise refusal
    assert str(raised.value) == "--steps: expected a positive integer, got 0"
    assert raised.value.__cause__ is refusal


def test_a_refused_argument_outside_the_table_passes_through_untouched():
    from optimum_iobinding.errors import ArgumentError

    refusal = ArgumentError("clip_skip", "expected at most 11, got 12")
    with pytest.raises(ArgumentError) as raised:
        with cli.options_named({"num_inference_steps": "--steps"}):
            raise refusal
    assert raised.value is refusal


@pytest.mark.parametrize(
    "error",
    [
        ValueError("provider: expected a name"),
        FileNotFoundError("model: no such file"),
        TypeError("height and width: expected integers"),
    ],
    ids=repr,
)
def test_an_error_that_names_no_argument_passes_through_though_its_text_looks_like_one(error):
    """The table is looked up with the refusal's ``argument``: an error's text is never parsed."""
    names = {"provider": "--provider", "model": "--model", "height and width": "--height and --width"}
    with pytest.raises(type(error)) as raised:
        with cli.options_named(names):
            raise error
    assert raised.value is error


def test_serve_names_a_model_path_that_is_no_pipeline_folder_before_starting_ray(tmp_path, capsys, monkeypatch):
    pytest.importorskip("ray.serve")
    import optimum_iobinding.serve as serve

    monkeypatch.setattr(serve, "run", lambda *args, **kwargs: pytest.fail("the service started"))
    (tmp_path / "model.onnx").write_bytes(b"")
    assert main(["serve", str(tmp_path / "model.onnx")]) == 2
    assert error_line(capsys) == (
        "optimum-iobinding: error: model: expected an ONNX pipeline folder or a hub id, got the file "
        f"{str(tmp_path / 'model.onnx')!r}"
    )


# ------------------------------------------------------------------------------------------ help with mistakes
@pytest.mark.parametrize(
    "argv, suggestion",
    [
        (["generate", "--stpes", "4"], "--stpes (did you mean --steps?)"),
        (["serve", "--max-batch", "4"], "--max-batch (did you mean --max-batch-size?)"),
        (["export", "--tiny-randm", "--output", "x"], "--tiny-randm (did you mean --tiny-random?)"),
        (["bench", "--modls", "tiny"], "--modls tiny (did you mean --models?)"),
    ],
    ids=["generate", "serve", "export", "bench"],
)
def test_a_misspelled_option_is_one_line_with_the_option_it_is_close_to(capsys, no_work, argv, suggestion):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert error_line(capsys) == f"optimum-iobinding: error: unrecognized arguments: {suggestion}"


@pytest.mark.parametrize("option", ["--zzzzzz", "--frobnicate"])
def test_an_option_close_to_none_gets_no_suggestion(capsys, no_work, option):
    """``--frobnicate`` was "close" to ``--frames``: the two dashes every option has made up half of the likeness."""
    with pytest.raises(SystemExit):
        main(["generate", option])
    assert capsys.readouterr().err.rstrip().endswith(f"unrecognized arguments: {option}")


def test_a_scheduler_whose_module_is_missing_is_refused_before_the_model_loads(capsys, no_work, monkeypatch):
    monkeypatch.setitem(cli.SCHEDULER_MODULES, "lms", ("no_such_module_for_a_scheduler",))
    assert main(["generate", "--scheduler", "lms"]) == 2
    assert error_line(capsys) == (
        "optimum-iobinding: error: --scheduler: lms (LMSDiscreteScheduler) needs "
        "no_such_module_for_a_scheduler, which this environment lacks: pip install "
        "no_such_module_for_a_scheduler"
    )


def test_every_scheduler_offered_has_what_it_needs_installed_with_the_package():
    """setup.cfg installs what each scheduler needs (diffusers defines LMS only where scipy is there)."""
    import importlib.util

    for name, modules in cli.SCHEDULER_MODULES.items():
        assert name in cli.SCHEDULERS
        assert all(importlib.util.find_spec(module) for module in modules), name
    config = (Path(__file__).parents[1] / "setup.cfg").read_text()
    requires = config.split("install_requires =", 1)[1].split("\n[", 1)[0]
    assert "scipy" in requires


@pytest.mark.parametrize("scheduler", sorted(cli.SCHEDULERS))
def test_every_scheduler_offered_generates_an_image(tiny_folder, tmp_path, scheduler):
    out = tmp_path / "a.png"
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_folder),
                "--scheduler",
                scheduler,
                "--steps",
                "2",
                "--height",
                "64",
                "--width",
                "64",
                "--provider",
                "CPUExecutionProvider",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert out.is_file()


def test_an_image_beyond_the_hosts_memory_is_refused_before_the_model_loads(tiny_folder, tmp_path, capsys, no_work):
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_folder),
                "--height",
                "100000",
                "--width",
                "100000",
                "--provider",
                "CPUExecutionProvider",
                "--out",
                str(tmp_path / "a.png"),
            ]
        )
        == 2
    )
    line = error_line(capsys)
    assert line.startswith("optimum-iobinding: error: --height and --width: 100000×100000 needs about ")
    assert ", the host's available memory; at most about " in line
    assert not (tmp_path / "a.png").exists()


def test_serve_takes_a_step_cache_as_generate_does(tmp_path, capsys, no_work):
    """``serve --cache`` (docs/serving.md, ``ServeConfig.cache``) reaches the service's config, checked and named as
    the command line names it."""
    args = cli.build_parser().parse_args(["serve", str(tmp_path), "--cache", "deepcache:3"])
    assert cli.check_serve_arguments(args, str(tmp_path)).cache == "deepcache:3"
    assert main(["serve", str(tmp_path), "--cache", "sometimes"]) == 2
    assert error_line(capsys).startswith("optimum-iobinding: error: --cache: ")


def test_generate_takes_the_prompt_as_an_option_too_but_only_once(tmp_path, capsys, no_work):
    """``stream`` and ``loadtest`` take ``--prompt``; ``generate`` took its prompt only positionally, and answered
    ``--prompt`` with "did you mean --negative-prompt?"."""
    args = cli.build_parser().parse_args(["generate", "--prompt", "a cat", "--out", str(tmp_path / "a.png")])
    cli.check_generate_arguments(args)
    assert args.prompt == "a cat"
    args = cli.build_parser().parse_args(["generate", "--out", str(tmp_path / "a.png")])
    cli.check_generate_arguments(args)
    assert args.prompt == cli.DEFAULT_PROMPT
    assert main(["generate", "a dog", "--prompt", "a cat", "--out", str(tmp_path / "a.png")]) == 2
    assert error_line(capsys) == (
        "optimum-iobinding: error: --prompt: expected the prompt once, got 'a dog' and --prompt 'a cat'"
    )


# ------------------------------------------------------------------------------------- the command line's words
@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--steps", "many"], "--steps: invalid int value: 'many'"),
        (["export", "--tiny-random"], "the following arguments are required: --output/-o"),
        (["stream", "in", "out"], "the following arguments are required: --prompt"),
        (["serve", "--port", "x"], "--port: invalid int value: 'x'"),
        (["loadtest"], "the following arguments are required: url"),
        (["bench", "--runs", "x"], "--runs: invalid int value: 'x'"),
        (["no-such-command"], "command: invalid choice: 'no-such-command'"),
        ([], "command: expected one of generate, serve, loadtest, stream, bench, export, got none (see --help)"),
        (["--debug"], "command: expected one of generate"),
    ],
    ids=["generate", "export", "stream", "serve", "loadtest", "bench", "top", "no-command", "debug-alone"],
)
def test_a_mistake_argparse_finds_is_one_line_without_the_usage_block(capsys, no_work, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert error_line(capsys).startswith(f"optimum-iobinding: error: {message}")


@pytest.fixture
def missing_module(monkeypatch):
    """``missing_module(name)``: the import system finds no module ``name`` (an extra not installed)."""
    import importlib.util

    find_spec = importlib.util.find_spec
    missing = set()
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name in missing else find_spec(name, *args)
    )
    return missing.add


@pytest.mark.parametrize(
    "argv, module, message",
    [
        (["stream", "{tmp}/in.mp4", "{tmp}/out", "--prompt", "a cat"], "av", "INPUT: the video file '{tmp}/in.mp4'"),
        (["stream", "{tmp}", "{tmp}/out.mp4", "--prompt", "a cat"], "av", "OUTPUT: the video file '{tmp}/out.mp4'"),
        (["serve", "{tmp}"], "ray", "serve: expected the serve extra (Ray Serve), missing ray"),
    ],
    ids=["stream-input", "stream-output", "serve"],
)
def test_a_missing_extra_is_refused_before_any_work_with_status_2(
    tmp_path, capsys, no_work, missing_module, argv, module, message
):
    """README: a mistake, status 2 — an extra the command needs and this environment lacks is one, for every
    command (`stream` answered 1)."""
    (tmp_path / "in.mp4").write_bytes(b"")
    missing_module(module)
    assert main([arg.format(tmp=tmp_path) for arg in argv]) == 2
    line = error_line(capsys)
    assert line.startswith(f"optimum-iobinding: error: {message.format(tmp=tmp_path)}"), line
    assert "pip install 'optimum-iobinding[" in line


# what the command line never says: the Python names of the parameters it fills, or the reprs of their values
PYTHON_WORDS = (
    "pretrained_model_name_or_path",
    "cache_interval",
    "cache_branch_id",
    "path:",
    "unet:",
    "Config(",
    "None",
)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cache", "deepcache:0"], "--cache deepcache:INTERVAL: expected an integer ≥ 1, got 0"),
        (["--cache", "deepcache:3:-1"], "--cache deepcache:INTERVAL:BRANCH: expected an integer ≥ 0, got -1"),
        (["--cache", "fbc:-1"], "--cache fbc:THRESHOLD: expected a number ≥ 0, got -1.0"),
        (
            ["--cache", "fbc:0.08"],
            "--cache: expected deepcache:INTERVAL[:BRANCH] (DeepCache: SD 1.x/2.x, SDXL, LCM) for "
            "OnnxStableDiffusionPipeline, got 'fbc:0.08', which is fbc:THRESHOLD (First-Block Cache: SD3, FLUX.1, Wan)",
        ),
    ],
    ids=["interval", "branch", "threshold", "other-cache"],
)
def test_generate_names_a_step_cache_it_refuses_by_the_spec_before_the_model_loads(
    tiny_folder, tmp_path, capsys, no_work, argv, message
):
    assert main(["generate", "--model", str(tiny_folder), "--out", str(tmp_path / "a.png"), *argv]) == 2
    line = error_line(capsys)
    assert line == f"optimum-iobinding: error: {message}"
    assert not any(word in line for word in PYTHON_WORDS), line


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["generate", "--model", "{tmp}/model.onnx"],
            "--model: expected an ONNX pipeline folder or a hub id, got the file '{tmp}/model.onnx'",
        ),
        (
            ["export", "{tiny}", "--output", "{tmp}/out"],
            "model: expected a diffusers pipeline to export (its torch weights), got '{tiny}', an ONNX folder already "
            "(text_encoder/model.onnx, unet/model.onnx, vae_decoder/model.onnx, vae_encoder/model.onnx): run it with "
            "generate --model",
        ),
    ],
    ids=["generate-a-file", "export-an-export"],
)
def test_a_model_of_another_kind_is_refused_by_its_option_before_any_work(
    tiny_folder, tmp_path, capsys, no_work, argv, message
):
    (tmp_path / "model.onnx").write_bytes(b"")
    assert main([arg.format(tmp=tmp_path, tiny=tiny_folder) for arg in argv]) == 2
    assert error_line(capsys) == f"optimum-iobinding: error: {message.format(tmp=tmp_path, tiny=tiny_folder)}"


def test_serve_names_a_step_cache_the_folder_cannot_take_before_starting_ray(tiny_folder, capsys, no_work):
    pytest.importorskip("ray.serve")
    assert main(["serve", str(tiny_folder), "--cache", "fbc:0.08"]) == 2
    assert error_line(capsys).startswith(
        "optimum-iobinding: error: --cache: expected deepcache:INTERVAL[:BRANCH] (DeepCache: SD 1.x/2.x, SDXL, LCM) "
        "for OnnxStableDiffusionPipeline, got 'fbc:0.08'"
    )


def test_export_names_a_tiny_vae_a_transformer_pipeline_cannot_take_in_the_commands_words(tmp_path, capsys, no_work):
    assert main(["export", "--tiny-random", "sd3", "--tiny-vae", "--output", str(tmp_path / "out")]) == 2
    assert error_line(capsys) == (
        "optimum-iobinding: error: --tiny-vae: expected none for a Stable Diffusion 3 pipeline (its export writes "
        "its own VAE and no ControlNet), got --tiny-vae without a value (a tiny random one)"
    )


@pytest.fixture
def folder_with_unet(tiny_folder, tmp_path):
    """``folder_with_unet(change)``: a copy of tiny_folder whose UNet graph ``change(model)`` changed in place."""
    import shutil

    import onnx

    def make(change):
        folder = tmp_path / "model"
        shutil.copytree(tiny_folder, folder)
        model = onnx.load(str(folder / "unet" / "model.onnx"))
        change(model)
        onnx.save(model, str(folder / "unet" / "model.onnx"))
        return folder

    return make


def as_exported_for_cuda(model):
    """The first convolution as ORT's CUDA fusion writes it: com.microsoft NhwcConv (no CPU kernel) on channels-last
    data and weights, between transposes."""
    from onnx import helper, numpy_helper

    index, conv = next((i, node) for i, node in enumerate(model.graph.node) if node.op_type == "Conv")
    weight = next(tensor for tensor in model.graph.initializer if tensor.name == conv.input[1])
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight).transpose(0, 2, 3, 1), weight.name))
    source, result = conv.input[0], conv.output[0]
    conv.input[0], conv.output[0] = f"{source}_nhwc", f"{result}_nhwc"
    conv.op_type, conv.domain = "NhwcConv", "com.microsoft"
    model.graph.node.insert(index, helper.make_node("Transpose", [source], [conv.input[0]], perm=[0, 2, 3, 1]))
    model.graph.node.insert(index + 2, helper.make_node("Transpose", [conv.output[0]], [result], perm=[0, 3, 1, 2]))
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))


def with_an_unknown_input(model):
    """The UNet with an input no family's UNet takes."""
    from onnx import TensorProto, helper

    model.graph.input.append(helper.make_tensor_value_info("style", TensorProto.FLOAT, ["batch", 32]))


GENERATE_ON_THE_CPU = ["--steps", "1", "--height", "64", "--width", "64", "--provider", "CPUExecutionProvider"]


def test_a_folder_exported_for_cuda_run_on_the_cpu_gets_the_cause_and_what_to_do(folder_with_unet, tmp_path, capsys):
    folder = folder_with_unet(as_exported_for_cuda)
    assert main(["generate", "--model", str(folder), *GENERATE_ON_THE_CPU, "--out", str(tmp_path / "a.png")]) == 2
    line = error_line(capsys)
    assert line.startswith(f"optimum-iobinding: error: --model: {str(folder / 'unet' / 'model.onnx')!r} was exported ")
    assert "NhwcConv" in line and "--optimize cpu" in line and "CUDAExecutionProvider" in line
    assert "Failed to find kernel" not in line and "Could not find an implementation" not in line


def test_a_component_the_pipeline_refuses_is_named_as_the_models(folder_with_unet, tmp_path, capsys):
    from PIL import Image

    folder = folder_with_unet(with_an_unknown_input)
    (tmp_path / "frames").mkdir()
    Image.new("RGB", (64, 64)).save(tmp_path / "frames" / "0.png")
    argv = ["stream", str(tmp_path / "frames"), str(tmp_path / "out"), "--prompt", "a cat", "--model", str(folder)]
    assert main([*argv, "--provider", "CPUExecutionProvider"]) == 2
    line = error_line(capsys)
    assert line.startswith("optimum-iobinding: error: --model (unet/): expected inputs "), line
    assert not any(word in line for word in PYTHON_WORDS), line


# ------------------------------------------------------------------------- files the work would fail to write
UNWRITABLE = "/proc/optimum-iobinding-test"  # refuses new files, for root too (a permission bit does not)


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux's /proc")
def test_an_out_that_cannot_be_written_is_refused_before_any_work(capsys, no_work):
    assert main(["generate", "--out", f"{UNWRITABLE}/x.png"]) == 2
    assert error_line(capsys).startswith(
        f"optimum-iobinding: error: --out: expected a writable folder for '{UNWRITABLE}/x.png', but '/proc' takes no "
        "new file"
    )


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux's /proc")
@pytest.mark.parametrize(
    "argv",
    [["generate", "--out", "{tmp}/a.png"], ["stream", "{tmp}", "{tmp}/out", "--prompt", "a cat"], ["serve"]],
    ids=["generate", "stream", "serve"],
)
def test_a_cache_dir_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys, no_work, argv):
    assert main([*(arg.format(tmp=tmp_path) for arg in argv), "--cache-dir", UNWRITABLE]) == 2
    assert error_line(capsys).startswith(
        f"optimum-iobinding: error: --cache-dir: expected a folder where the tiny model can be built, got "
        f"'{UNWRITABLE}', but '/proc' takes no new file"
    )


def test_a_cache_dir_holding_the_tiny_model_is_only_read(tmp_path, monkeypatch):
    """A cache that cannot be written serves once the tiny model is in it."""
    (tmp_path / "tiny-random-sd").mkdir()
    (tmp_path / "tiny-random-sd" / "model_index.json").write_text("{}")
    monkeypatch.setattr(cli, "unwritable_reason", lambda folder: "it is read-only")
    cli.check_cache_dir(str(tmp_path))


# ---------------------------------------------------------------------------------------------- what it prints
@pytest.mark.parametrize(
    "steps, scheduler, strength, ran, summary",
    [
        ("3", "pndm", None, 3, "3 steps in "),
        ("1", "ddim", None, 1, "1 step in "),
        ("4", "ddim", "0.5", 2, "2 of 4 steps (--strength 0.5) in "),
        ("4", "pndm", "0.5", 2, "2 of 4 steps (--strength 0.5) in "),
        ("5", "ddim", "", 4, "4 of 5 steps (the pipeline's default strength) in "),
    ],
    ids=["pndm", "one-step", "strength", "pndm-strength", "default-strength"],
)
def test_the_progress_bar_counts_the_steps_asked_for_that_run_and_the_summary_no_rate_it_cannot_measure(
    tiny_folder, tmp_path, capsys, steps, scheduler, strength, ran, summary
):
    """PNDM calls the UNet once more than the steps (its first step twice): the bar still ends at the steps asked
    for; --strength runs the last part of them (the bar stopped at 2/4, the summary said 4 steps); one step has no
    interval to give a rate of ("nan ms/step")."""
    argv = ["generate", "--model", str(tiny_folder), "--steps", steps, "--scheduler", scheduler, "--height", "64"]
    if strength is not None:
        Image.new("RGB", (64, 64), (90, 140, 200)).save(tmp_path / "in.png")
        argv += ["--image", str(tmp_path / "in.png"), *(["--strength", strength] if strength else [])]
    assert main([*argv, "--width", "64", "--provider", "CPUExecutionProvider", "--out", str(tmp_path / "a.png")]) == 0
    captured = capsys.readouterr()
    bars = [part for part in captured.err.replace("\r", "\n").splitlines() if "|" in part]
    assert bars and bars[-1].lstrip().startswith("100%") and f"| {ran}/{ran} [" in bars[-1], bars
    assert summary in captured.out and "nan" not in captured.out
    assert ("ms/step" in captured.out) == (ran != 1)


def test_export_shows_no_warning_of_onnx_runtimes_shape_inference(tmp_path, caplog, monkeypatch):
    """ORT's symbolic shape inference logs "Cannot determine if floor(height/2) + … < 0" while SD3's step cache is
    exported (8 lines): a library's notice, not the command's."""
    import logging

    import optimum_iobinding.export as export

    logger = logging.getLogger("onnxruntime.tools.symbolic_shape_infer")
    for name in ("onnxruntime", "symbolic_shape_infer"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)  # restored after

    def exporter(model, output_dir, **kwargs):
        logger.warning("Cannot determine if floor(height/2) + floor(-floor(height/2)/2) + 16 < 0")
        return Path(output_dir)

    monkeypatch.setattr(export, "export_pipeline", exporter)
    caplog.set_level(logging.WARNING)
    assert main(["export", "--tiny-random", "sd3", "--step-cache", "--output", str(tmp_path / "out")]) == 0
    assert not [record for record in caplog.records if "Cannot determine" in record.getMessage()]


def test_the_tiny_models_are_built_without_diffusers_float32_notice(monkeypatch):
    """The examples build the tiny models: diffusers' ``.to(torch.float32)`` said "There are modules in
    UNet2DConditionModel that should be kept in float32: []" for each model."""
    import logging

    import diffusers.utils.logging as diffusers_logging

    from optimum_iobinding.export.tiny import build_tiny_random_pipeline

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    root = logging.getLogger("diffusers")
    monkeypatch.setattr(root, "level", root.level)  # restored after
    diffusers_logging.set_verbosity_warning()
    handler = Keep()
    root.addHandler(handler)
    try:
        pipe = build_tiny_random_pipeline()
    finally:
        root.removeHandler(handler)
    assert not [message for message in records if "kept in float32" in message], records
    assert {parameter.dtype for parameter in pipe.unet.parameters()} == {torch.float32}


# ------------------------------------------------------------------------------------------------------ --help
@pytest.mark.parametrize("command", ["generate", "export", "stream", "serve", "loadtest", "bench"])
def test_help_describes_every_option_and_gives_its_default(command):
    import argparse

    from optimum_iobinding.bench.cli import build_parser as bench_parser

    parser = bench_parser() if command == "bench" else cli.build_parser()._defaults["command_parsers"][command]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or "--help" in action.option_strings:
            continue
        text = formatter._get_help_string(action) if action.help else ""
        assert text, f"{command} {action.option_strings[0]}: no help"
        if not any(action.default is none for none in (None, False, argparse.SUPPRESS)):
            assert "default" in text, f"{command} {action.option_strings[0]}: no default in {text!r}"


@pytest.mark.parametrize(
    "command, option",
    [
        ("generate", "--scheduler"),
        ("export", "--optimize"),
        ("loadtest", "--out"),
        ("bench", "--blocks"),
        ("bench", "--optimum-pythonpath"),
    ],
)
def test_help_says_what_an_option_left_out_means(command, option):
    """Options whose default is None that still choose something: the model's own scheduler, no optimizer, the
    table printed only, the full model's blocks, this environment's packages."""
    from optimum_iobinding.bench.cli import build_parser as bench_parser

    parser = bench_parser() if command == "bench" else cli.build_parser()._defaults["command_parsers"][command]
    (action,) = [action for action in parser._actions if option in action.option_strings]
    assert "(default: " in action.help, action.help


def test_generate_help_names_the_prompt_option_as_the_user_writes_it_and_bench_help_lists_debug():
    generate_help = cli.build_parser()._defaults["command_parsers"]["generate"].format_help()
    assert "--prompt PROMPT " in generate_help and "PROMPT_OPTION" not in generate_help
    from optimum_iobinding.bench.cli import build_parser as bench_parser

    assert "--debug" in bench_parser().format_help()


def test_the_bench_export_prints_no_library_notices(tmp_path):
    """``bench --export-only`` printed transformers' two "requires torchvision" warnings (diffusers' pipelines it
    builds the random models with import transformers' image processors): the bench quiets the libraries as the
    other commands do."""
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "optimum_iobinding.cli",
            "bench",
            "--export-only",
            "--models",
            "tiny",
            "--dtypes",
            "fp32",
        ]
        + ["--exports", "plain", "--work", str(tmp_path)],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == [str(tmp_path / "tiny-fp32-plain")]
    for notice in ("[transformers]", "Warning", "WARNING", "deprecated"):
        assert notice not in completed.stderr, completed.stderr


def test_exports_help_names_every_tiny_random_kind_and_every_family_it_exports():
    from optimum_iobinding.families import tiny_random_kinds

    parser = cli.build_parser()._defaults["command_parsers"]["export"]
    helps = {action.dest: action.help for action in parser._actions}
    named = set(re.findall(r"[a-z0-9.-]+", helps["tiny_random"]))
    assert [kind for kind in tiny_random_kinds() if kind not in named] == []
    assert all(name in helps["model"] for name in ("SDXL", "SD3", "FLUX.1", "Wan"))


# --------------------------------------------------------------------------------------- what the docs tell
def python_snippets(text: str) -> list:
    return [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]


README = (REPOSITORY / "README.md").read_text()


def test_the_readme_says_where_its_snippets_folders_come_from_offline():
    first = next(block for block in python_snippets(README) if '"sd-onnx"' in block)
    assert "export MODEL --output sd-onnx" in first and "export --tiny-random" in first


def test_the_export_docs_give_export_pipelines_whole_signature():
    """docs/export.md gave ``export_pipeline``'s signature without seven of its parameters (``ip_adapter``,
    ``cold_start_parts``, ``vae_dtype`` …)."""
    import inspect

    from optimum_iobinding.export import export_pipeline

    text = " ".join((REPOSITORY / "docs" / "export.md").read_text().split())
    (documented,) = re.findall(r"`optimum_iobinding\.export\.export_pipeline\(([^`]*)\)`", text)
    parameters = []
    for parameter in inspect.signature(export_pipeline).parameters.values():
        if parameter.kind is parameter.KEYWORD_ONLY and "*" not in parameters:
            parameters.append("*")
        parameters.append(parameter.name + ("" if parameter.default is parameter.empty else f"={parameter.default!r}"))
    assert documented.split(", ") == parameters


def test_the_readme_stream_snippet_imports_its_class():
    (snippet,) = [block for block in python_snippets(README) if "OnnxStreamDiffusionPipeline.from_pretrained" in block]
    assert "from optimum_iobinding import OnnxStreamDiffusionPipeline" in snippet


def test_the_readme_names_every_example_and_stays_within_300_lines():
    assert [path.stem for path in sorted((REPOSITORY / "examples").glob("*.py")) if path.stem not in README] == []
    assert len(README.splitlines()) <= 300


def test_the_size_multiple_of_a_stream_is_documented_as_the_unet_needs_it():
    """8 × 2^(down blocks − 1), as the UNet denoiser's ``size_multiple`` computes it (the docs said 8)."""
    rule = "8 × 2^(the UNet's down blocks − 1)"
    stream = cli.build_parser()._defaults["command_parsers"]["stream"]
    (size,) = [action for action in stream._actions if "--size" in action.option_strings]
    streams_doc = " ".join((REPOSITORY / "docs" / "streams.md").read_text().split())
    assert rule in size.help and rule in streams_doc and "size multiple (8)" not in streams_doc


def test_what_generate_and_the_examples_write_by_default_is_ignored_by_git():
    import fnmatch
    import re

    patterns = [
        line.strip()
        for line in (REPOSITORY / ".gitignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    written = [cli.DEFAULT_IMAGE_OUT, cli.DEFAULT_VIDEO_OUT]
    for example in (REPOSITORY / "examples").glob("*.py"):
        written += re.findall(r'add_argument\("--out", default="([^"]+)"', example.read_text())
    assert len(written) >= 9
    ignored = lambda name: any(fnmatch.fnmatch(name, pattern.lstrip("/")) for pattern in patterns)  # noqa: E731
    assert [name for name in written if not ignored(name)] == []


def test_the_folders_the_docs_commands_and_the_bench_write_are_ignored_by_git():
    """``export ... --output sd-onnx`` run in the checkout, as the README has it, left ``sd-onnx/`` untracked (its
    config and tokenizer files; only ``*.onnx`` was ignored), and the bench its ``bench-work/``."""
    import fnmatch

    from optimum_iobinding.bench.cli import build_parser as bench_parser

    patterns = [
        line.strip().strip("/")
        for line in (REPOSITORY / ".gitignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    docs = [REPOSITORY / "README.md", *sorted((REPOSITORY / "docs").glob("*.md"))]
    written = {
        folder.rstrip("/")
        for doc in docs
        for folder in re.findall(r"(?:--output|-o|--out) ([A-Za-z0-9_.-]+/?)(?=[\s`])", doc.read_text())
        if not folder.startswith("-") and not folder.endswith((".png", ".mp4", ".jpg")) and folder.upper() != folder
    }
    bench = bench_parser()
    written |= {bench.get_default("work"), bench.get_default("out")}
    assert {"sd-onnx", "sd15-canny-onnx", "loadtest", "bench-work"} <= written
    ignored = lambda name: any(fnmatch.fnmatch(name, pattern) for pattern in patterns)  # noqa: E731
    assert sorted(name for name in written if not ignored(name)) == []


@pytest.mark.skipif(
    "CUDAExecutionProvider" in ort.get_available_providers(),
    reason="checks the hint given where onnxruntime has no CUDA provider",
)
def test_the_gpu_hint_says_to_remove_onnxruntime_before_installing_the_gpu_extra(capsys, no_work):
    """onnxruntime and onnxruntime-gpu are one module: installed over the CPU build, the GPU one breaks both."""
    assert main(["generate", "--provider", "CUDAExecutionProvider"]) == 2
    assert "pip uninstall -y onnxruntime && pip install 'optimum-iobinding[gpu]'; available: " in error_line(capsys)


def test_a_diffusers_folder_holding_onnx_files_beside_its_torch_weights_is_not_taken_for_an_export(tmp_path, capsys):
    """Some hub folders ship ONNX files beside the torch weights (SDXL base has unet/model.onnx): they export (this
    one's empty files fail later, in the export)."""
    (tmp_path / "model" / "unet").mkdir(parents=True)
    (tmp_path / "model" / "model_index.json").write_text("{}")
    (tmp_path / "model" / "unet" / "model.onnx").write_bytes(b"")
    (tmp_path / "model" / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    main(["export", str(tmp_path / "model"), "--output", str(tmp_path / "out")])
    assert "ONNX folder already" not in capsys.readouterr().err


@pytest.mark.parametrize("index", [{"unet": ["diffusers", "UNet2DConditionModel"]}, {"_class_name": 3}])
def test_export_of_a_folder_whose_model_index_names_no_pipeline_class_says_so(tmp_path, capsys, no_work, index):
    """diffusers' loader answers such a folder with a bare ``KeyError: '_class_name'``."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model_index.json").write_text(json.dumps(index))
    assert main(["export", str(tmp_path / "model"), "--output", str(tmp_path / "out")]) == 2
    assert re.search(r'model_index.json: expected "_class_name": the diffusers pipeline class', error_line(capsys))


def test_the_export_script_refuses_in_one_line_as_the_command_does(tmp_path):
    """scripts/export_models.py is ``optimum-iobinding export`` under another name: a mistake is one line, status 2,
    no traceback."""
    completed = subprocess.run(
        [sys.executable, "scripts/export_models.py", "--tiny-random", "--opset", "12", "--output", str(tmp_path / "o")],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 2, completed.stderr
    assert completed.stderr.strip().splitlines() == [
        "optimum-iobinding: error: --opset: expected an integer in 14 … 20 (17 is tested), got 12"
    ]
    assert not (tmp_path / "o").exists()


EXAMPLES_WRITING = sorted(
    path.stem for path in (REPOSITORY / "examples").glob("*.py") if 'add_argument("--out"' in path.read_text()
)


def run_example(name: str, argv: list, monkeypatch) -> int:
    """examples/NAME.py run as ``python examples/NAME.py ARGV`` would, in this process; its exit status."""
    import runpy

    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    monkeypatch.syspath_prepend(str(REPOSITORY / "examples"))  # as python puts the script's folder first
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPOSITORY / "examples" / f"{name}.py"), run_name="__main__")
    return exit_info.value.code


@pytest.mark.parametrize("name", EXAMPLES_WRITING)
def test_an_example_refuses_an_out_it_cannot_write_in_one_line_before_any_work(name, tmp_path, monkeypatch, capsys):
    """Its --out was written after the work (a video extension failed in PIL then), with a traceback."""
    assert run_example(name, ["--out", str(tmp_path / "x.mp4")], monkeypatch) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{name}.py: error: --out: expected a file name with an image "), (
        lines
    )
    assert os.listdir(tmp_path) == []


def test_an_example_names_its_own_option_for_a_refused_provider(monkeypatch, capsys):
    assert run_example("bind_model", ["--provider", "NoSuchExecutionProvider"], monkeypatch) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [lines[-1]] and lines[0].startswith("bind_model.py: error: --provider: 'NoSuchExecutionProvider'")
