"""Export never destroys what it did not make (CPU, the tiny random pipeline): an export onto its source or a
folder holding it is refused, a folder that is not empty is replaced only when asked and then whole, and a failed
export leaves the previous one exactly as it was. An output folder that cannot be written is named as the caller gave
it, never by the temporary folder built beside it."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest

from optimum_iobinding.export import export_pipeline
from optimum_iobinding.export.tiny import build_tiny_random_pipeline


# ------------------------------------------------------------------------------------------------- data loss
def torch_source(tmp_path) -> Path:
    """A diffusers (torch) folder, as users export from."""
    folder = tmp_path / "source"
    build_tiny_random_pipeline().save_pretrained(folder)
    return folder


def test_export_onto_its_own_source_is_refused_and_the_source_is_untouched(tmp_path, snapshot):
    source = torch_source(tmp_path)
    before = snapshot(source)
    for output in (source, source / "onnx"):
        with pytest.raises(ValueError, match=r"output_dir: expected a folder outside the source folder"):
            export_pipeline(str(source), output, progress=False, overwrite=True)
    assert snapshot(source) == before


def test_export_onto_a_folder_that_holds_the_source_is_refused(tmp_path, snapshot):
    source = torch_source(tmp_path)
    before = snapshot(source)
    with pytest.raises(ValueError, match=r"output_dir: expected a folder that does not hold the source folder"):
        export_pipeline(str(source), tmp_path, progress=False, overwrite=True)
    assert snapshot(source) == before


def test_export_into_a_non_empty_folder_is_refused_without_overwrite(tmp_path, snapshot):
    target = tmp_path / "target"
    (target / "unet").mkdir(parents=True)
    (target / "unet" / "my_notes.txt").write_text("mine")
    (target / "model_index.json").write_text('{"mine": true}')
    before = snapshot(target)
    with pytest.raises(
        FileExistsError,
        match=r"output_dir: expected a new or empty folder, got .* holding 2 "
        r"entries \(model_index.json, unet\); pass overwrite=True to "
        r"replace it whole, or choose another folder$",
    ):
        export_pipeline(None, target, tiny_random=True, progress=False)
    assert snapshot(target) == before


def test_export_with_overwrite_replaces_the_folder_whole(tmp_path):
    target = tmp_path / "target"
    export_pipeline(None, target, tiny_random="xl", progress=False, components=("vae_decoder", "text_encoder_2"))
    (target / "unet").mkdir()
    (target / "unet" / "my_notes.txt").write_text("stale")
    export_pipeline(None, target, tiny_random=True, progress=False, components=("vae_decoder",), overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == ["model_index.json", "scheduler", "tokenizer", "vae_decoder"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch folders left


@pytest.mark.parametrize("appears", ["a user's file", "another export", "an empty folder"])
def test_a_folder_filled_while_the_export_runs_is_left_as_it_is(tmp_path, appears):
    """Checked new before the work, the output folder is filled by something else while the export traces its
    models: without overwrite nothing of it is replaced (an empty folder is, as it would have been at the start)."""
    target = tmp_path / "target"
    pipe = build_tiny_random_pipeline()
    encode = pipe.vae.encode

    def filling(*args, **kwargs):  # runs while the export traces the VAE encoder, the folder still new
        if not target.exists():
            target.mkdir()
            if appears == "a user's file":
                (target / "notes.txt").write_text("mine")
            elif appears == "another export":
                (target / "model_index.json").write_text("{}")
        return encode(*args, **kwargs)

    pipe.vae.encode = filling
    arguments = dict(torch_pipeline=pipe, progress=False, components=("vae_encoder",))
    if appears == "an empty folder":
        export_pipeline(None, target, **arguments)
        assert (target / "vae_encoder" / "model.onnx").is_file()
    else:
        with pytest.raises(
            FileExistsError,
            match=r"output_dir: expected a new or empty folder, got .*target.*, which "
            r"something else filled while this one was written; it was left as it is",
        ):
            export_pipeline(None, target, **arguments)
        assert [p.name for p in target.iterdir()] == ["notes.txt" if appears == "a user's file" else "model_index.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]  # no scratch folder left


def test_an_output_that_links_to_an_empty_folder_is_replaced_by_the_export(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "target").symlink_to(tmp_path / "elsewhere")
    export_pipeline(None, tmp_path / "target", tiny_random=True, progress=False, components=("vae_decoder",))
    assert (tmp_path / "target" / "vae_decoder" / "model.onnx").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "target"]  # no scratch folder left


def pipeline_failing_at_its_vae_encoder(error: type):
    """The tiny torch pipeline, but its VAE encoder raises ``error`` when the export traces it."""
    pipe = build_tiny_random_pipeline()

    def failing(*args, **kwargs):
        raise error("injected")

    pipe.vae.encode = failing
    return pipe


@pytest.mark.parametrize("failure", ["bad opset", "error in the last component", "interrupt"])
def test_a_failed_export_leaves_the_previous_export_exactly_as_it_was(tmp_path, failure, snapshot):
    target = tmp_path / "target"
    components = ("vae_decoder", "vae_encoder")  # the encoder last: everything before it was written when it fails
    export_pipeline(None, target, tiny_random=True, progress=False, components=components)
    before = snapshot(target)
    arguments = dict(progress=False, overwrite=True, components=components)
    if failure == "bad opset":
        expected = ValueError
        arguments.update(tiny_random=True, opset=1)
    else:
        expected = RuntimeError if failure == "error in the last component" else KeyboardInterrupt
        arguments.update(torch_pipeline=pipeline_failing_at_its_vae_encoder(expected))
    with pytest.raises(expected, match="opset" if failure == "bad opset" else "injected"):
        export_pipeline(None, target, **arguments)
    assert snapshot(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]  # no half-built folder beside it


# ------------------------------------------------------------------------------------------- unwritable targets
@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no folder can be made")
def test_an_output_dir_where_no_folder_can_be_made_is_named_before_any_work(tmp_path):
    with pytest.raises(
        OSError,
        match=r"^output_dir: expected a folder that can be written, got '/proc/x': making a "
        r"folder in '/proc' failed \(No such file or directory\)$",
    ) as refused:
        export_pipeline(None, "/proc/x", tiny_random=True, progress=False)
    assert "partial" not in str(refused.value) and refused.value.errno == errno.ENOENT


def test_an_output_dir_below_a_file_is_named(tmp_path):
    (tmp_path / "file").write_text("mine")
    with pytest.raises(
        NotADirectoryError,
        match=r"^output_dir: expected a folder that can be written, got "
        r"'.*file/onnx', but '.*file' is not a folder$",
    ):
        export_pipeline(None, tmp_path / "file" / "onnx", tiny_random=True, progress=False)
    assert (tmp_path / "file").read_text() == "mine"


def test_a_write_that_fails_inside_the_export_names_the_output_dir_and_what_was_written(tmp_path):
    pipe = build_tiny_random_pipeline()

    def disk_full(folder, **kwargs):  # as a full disk fails: naming the file being written
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(folder, "scheduler_config.json"))

    pipe.scheduler.save_pretrained = disk_full
    target = tmp_path / "onnx"
    expected = (
        rf"^output_dir: expected a folder that can be written, got '{re.escape(str(target))}': writing "
        r"scheduler/scheduler_config.json failed \(No space left on device\)$"
    )
    with pytest.raises(OSError, match=expected) as failed:
        export_pipeline(None, target, torch_pipeline=pipe, components=("vae_decoder",), progress=False)
    assert failed.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []  # neither the output nor the folder built beside it


# ------------------------------------------------------------------------------------------------- permissions
@pytest.fixture
def umask():
    """``umask(mask)``: the process's umask set to ``mask``; restored after the test."""
    before = os.umask(0o022)
    os.umask(before)
    yield os.umask
    os.umask(before)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o755), (0o077, 0o700)], ids=["umask-022", "umask-077"])
def test_an_export_has_the_permissions_the_umask_gives(tmp_path, umask, mask, mode):
    """The export was built in a folder from ``mkdtemp`` (mode 0700) and moved into place: a server running as
    another user could not read it, whatever the umask said. The folders are made as ``mkdir`` makes them, the files
    as before."""
    umask(mask)
    target = tmp_path / "target"
    export_pipeline(None, target, tiny_random=True, progress=False, components=("vae_decoder",))
    folders = [target, *(path for path in target.rglob("*") if path.is_dir())]
    assert len(folders) >= 3 and {folder.stat().st_mode & 0o777 for folder in folders} == {mode}
    files = [path for path in target.rglob("*") if path.is_file()]
    assert files and {path.stat().st_mode & 0o777 for path in files} == {mode & 0o666}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]  # the temporary folder is gone
