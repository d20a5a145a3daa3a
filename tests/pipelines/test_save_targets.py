"""``save_pretrained`` into a folder that cannot be written (CPU, the tiny random export): the error names
``save_directory`` and the folder as the caller gave it, never the temporary folder built beside it, and nothing is
left behind."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest

from optimum_iobinding import OnnxStableDiffusionPipeline


@pytest.fixture(scope="module")
def pipe(tiny_folder):
    return OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no folder can be made")
def test_a_save_directory_where_no_folder_can_be_made_is_named(pipe):
    with pytest.raises(
        OSError,
        match=r"^save_directory: expected a folder that can be written, got '/proc/x': "
        r"making a folder in '/proc' failed \(No such file or directory\)$",
    ) as refused:
        pipe.save_pretrained("/proc/x")
    assert "partial" not in str(refused.value) and refused.value.errno == errno.ENOENT


def test_a_save_directory_below_a_file_is_named(pipe, tmp_path):
    (tmp_path / "file").write_text("mine")
    with pytest.raises(
        NotADirectoryError,
        match=r"^save_directory: expected a folder that can be written, got "
        r"'.*file/saved', but '.*file' is not a folder$",
    ):
        pipe.save_pretrained(tmp_path / "file" / "saved")
    assert (tmp_path / "file").read_text() == "mine"


def test_a_write_that_fails_while_saving_names_the_save_directory_and_what_was_written(pipe, tmp_path, monkeypatch):
    def disk_full(folder, **kwargs):  # as a full disk fails: naming the file being written
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(folder, "scheduler_config.json"))

    monkeypatch.setattr(pipe.scheduler, "save_pretrained", disk_full)
    target = tmp_path / "saved"
    expected = (
        rf"^save_directory: expected a folder that can be written, got '{re.escape(str(target))}': writing "
        r"scheduler/scheduler_config.json failed \(No space left on device\)$"
    )
    with pytest.raises(OSError, match=expected) as failed:
        pipe.save_pretrained(target)
    assert failed.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []  # neither the folder nor the one built beside it
