"""The command line speaks plainly: one line ``optimum-iobinding: error: …``, exit status 2 for a mistake in what was
asked (checked before any work), 1 for a failure while doing it, a traceback only with ``--debug``."""

from __future__ import annotations

import pytest
import torch

from optimum_iobinding import cli
from optimum_iobinding.cli import main


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if the command gets as far as loading a pipeline or exporting one."""
    import optimum_iobinding.export as export
    import optimum_iobinding.pipelines as pipelines

    def reached(*args, **kwargs):
        raise AssertionError("the command started working before it checked its arguments")

    monkeypatch.setattr(pipelines.OnnxStableDiffusionPipeline, "from_pretrained", reached)
    monkeypatch.setattr(export, "export_pipeline", reached)
    monkeypatch.setattr(cli, "tiny_model_folder", reached)


def error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines  # one line, no traceback
    return lines[0]


@pytest.mark.parametrize("out, message", [
    ("{tmp}", r"--out: expected an image file name, got the folder"),
    ("{tmp}/picture", r"--out: expected a file name with an image extension PIL can write \(.*\.png.*\), got"),
    ("{tmp}/picture.txt", r"--out: expected a file name with an image extension PIL can write"),
    ("{tmp}/file.png/x.png", r"--out: expected a writable folder for .* is not a folder"),
])
def test_a_bad_out_is_refused_before_any_work(tmp_path, capsys, no_work, out, message):
    (tmp_path / "file.png").write_bytes(b"")
    assert main(["generate", "--out", out.format(tmp=tmp_path)]) == 2
    import re

    line = error_line(capsys)
    assert line.startswith("optimum-iobinding: error: ") and re.search(message, line), line


@pytest.mark.parametrize("model", ["./models/sd15-onnx", "../nowhere/at/all", "/no/such/folder"])
def test_a_missing_local_model_is_reported_as_missing(capsys, no_work, model):
    assert main(["generate", "--model", model]) == 2
    assert f"--model: expected an existing local folder or a hub repository id, got {model!r}: no such file or " \
           "folder" in error_line(capsys)


@pytest.mark.parametrize("flag", ["--steps", "--height", "--width"])
def test_sizes_and_steps_must_be_positive(capsys, no_work, flag):
    assert main(["generate", flag, "0"]) == 2
    assert f"{flag}: expected a positive integer, got 0" in error_line(capsys)


def test_export_into_a_non_empty_folder_is_refused_before_exporting(tmp_path, capsys, no_work):
    (tmp_path / "mine.txt").write_text("mine")
    assert main(["export", "--tiny-random", "--output", str(tmp_path)]) == 2
    assert "--output: expected a new or empty folder" in error_line(capsys)
    assert (tmp_path / "mine.txt").read_text() == "mine"


def test_export_without_a_model_is_a_usage_error(tmp_path, capsys, no_work):
    assert main(["export", "--output", str(tmp_path / "x")]) == 2
    assert "export: give a model folder or hub id, or --tiny-random" in error_line(capsys)


@pytest.mark.parametrize("command", [[], ["generate"], ["export"], ["serve"], ["loadtest"], ["bench"]],
                         ids=["top", "generate", "export", "serve", "loadtest", "bench"])
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
def test_bench_without_a_gpu_exits_1_saying_why(tmp_path, capsys):
    assert main(["bench", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]) == 1
    assert "no CUDA GPU is visible to torch here" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()  # nothing exported or written first
