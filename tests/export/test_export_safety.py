"""Export never destroys what it did not make (CPU, the tiny random pipeline): an export onto its source or a
folder holding it is refused, a folder that is not empty is replaced only when asked and then whole, and a failed
export leaves the previous one exactly as it was."""

from __future__ import annotations

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
    with pytest.raises(FileExistsError, match=r"output_dir: expected a new or empty folder, got .* holding 2 "
                                              r"entries \(model_index.json, unet\); pass overwrite=True"):
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
