"""``generate`` on a video family's folder (Wan): ``--frames`` and ``--fps``, the video written to ``--out`` (a video
file through PyAV, or a folder of PNG frames), the frames the Python pipeline makes with the same arguments (CPU
execution provider); an output or an option of the other kind refused by name before any model loads; and the server,
which returns images, refusing the folder by its ``model`` before anything starts or loads."""

from __future__ import annotations

import re

import numpy as np
import PIL.Image
import pytest

from optimum_iobinding.cli import main
from tests.commands import error_line

PROMPT = "a red castle in the forest"
CALL = ["--provider", "CPUExecutionProvider", "--steps", "2", "--seed", "3", "--height", "16", "--width", "32"]


@pytest.fixture(scope="module")
def wan_folder(shared_export):
    """The tiny random Wan 2.1 export (shared with the pipeline's tests: ``export --tiny-random wan``)."""
    from optimum_iobinding.export import export_pipeline

    return shared_export(
        "tiny-random-wan", lambda target: export_pipeline(None, target, tiny_random="wan", progress=False)
    )


def test_a_wan_folder_writes_its_frames_as_the_pipeline_makes_them(wan_folder, tmp_path, capsys):
    from optimum_iobinding import OnnxWanPipeline

    out = tmp_path / "frames"  # a folder of PNG frames: lossless, so the pixels can be compared
    assert main(["generate", PROMPT, *CALL, "--frames", "5", "--model", str(wan_folder), "--out", str(out)]) == 0
    assert re.search(r"frames: 5 frames of 32×16 at 16 frames/s, 2 steps in", capsys.readouterr().out)
    written = [np.asarray(PIL.Image.open(path)) for path in sorted(out.glob("*.png"))]
    pipe = OnnxWanPipeline.from_pretrained(wan_folder, provider="CPUExecutionProvider")
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(
        prompt=PROMPT,
        height=16,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        generator=np.random.RandomState(3),
        output_type="np",
    ).frames[0]
    expected = (np.clip(frames, 0, 1) * 255).round().astype(np.uint8)
    assert len(written) == 5 and np.array_equal(np.stack(written), expected)


def test_a_video_file_holds_every_frame_at_its_rate(wan_folder, tmp_path):
    av = pytest.importorskip("av")
    out = tmp_path / "castle.mp4"
    assert (
        main(["generate", PROMPT, *CALL, "--frames", "9", "--fps", "8", "--model", str(wan_folder), "--out", str(out)])
        == 0
    )
    with av.open(str(out)) as video:
        stream = video.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in video.decode(stream)]
        assert stream.average_rate == 8
    assert len(frames) == 9 and frames[0].shape == (16, 32, 3)


@pytest.mark.parametrize(
    "wan, argv, message",
    [
        (True, ["--out", "{tmp}/a.png"], r"--out: expected a video file \(.mp4, .mkv, .mov, .webm\) or a folder for"),
        (False, ["--out", "{tmp}/a.mp4"], r"--out: expected an image file name for OnnxStableDiffusionPipeline \("),
        (False, ["--frames", "5"], r"--frames: expected none for OnnxStableDiffusionPipeline \(its calls make images"),
        (True, ["--frames", "0"], r"--frames: expected a positive integer \(4k \+ 1 for Wan"),
        (True, ["--fps", "0"], r"--fps: expected a positive number of frames per second, got 0.0"),
    ],
    ids=["image-out-for-wan", "video-out-for-sd", "frames-for-sd", "no-frames", "no-fps"],
)
def test_an_output_of_the_other_kind_is_refused_before_the_model_loads(
    wan_folder, tiny_folder, tmp_path, capsys, monkeypatch, wan, argv, message
):
    import optimum_iobinding.pipelines.core as core

    loaded = []
    monkeypatch.setattr(core.OnnxDiffusionPipeline, "from_pretrained", classmethod(lambda *a, **k: loaded.append(a)))
    folder = wan_folder if wan else tiny_folder
    argv = [part.format(tmp=tmp_path) for part in argv]
    assert main(["generate", PROMPT, "--model", str(folder), *argv]) == 2
    assert not loaded and re.search(message, error_line(capsys))
    assert list(tmp_path.iterdir()) == []


def test_a_frame_count_wan_cannot_make_is_refused_naming_frames_and_nothing_is_written(wan_folder, tmp_path, capsys):
    out = tmp_path / "castle.mp4"
    assert main(["generate", PROMPT, *CALL, "--frames", "6", "--model", str(wan_folder), "--out", str(out)]) == 2
    assert re.match(r"optimum-iobinding: error: --frames: expected .*4k \+ 1.*got 6", error_line(capsys))
    assert list(tmp_path.iterdir()) == []


def test_a_folder_of_the_users_is_never_replaced_by_frames(wan_folder, tmp_path, capsys):
    kept = tmp_path / "holiday"
    kept.mkdir()
    (kept / "photo.jpg").write_bytes(b"mine")
    assert main(["generate", PROMPT, *CALL, "--frames", "5", "--model", str(wan_folder), "--out", str(kept)]) == 2
    assert error_line(capsys).startswith("optimum-iobinding: error: --out: ")
    assert [path.name for path in kept.iterdir()] == ["photo.jpg"] and (kept / "photo.jpg").read_bytes() == b"mine"


def test_a_step_cache_runs_on_a_video_family_and_its_summary_says_what_it_did(shared_export, tmp_path, capsys):
    from optimum_iobinding.export import export_pipeline

    folder = shared_export(
        "tiny-random-wan-with-parts",
        lambda target: export_pipeline(None, target, tiny_random="wan", step_cache=True, progress=False),
    )
    argv = [*CALL, "--frames", "5", "--model", str(folder), "--out", str(tmp_path / "v.mp4"), "--cache", "fbc:0.9"]
    assert main(["generate", PROMPT, *argv]) == 0
    assert re.search(
        r"v\.mp4: 5 frames of 32×16 .*\(OnnxWanPipeline, CPUExecutionProvider; cache fbc:0\.9: \d of 2 "
        r"steps ran whole\)",
        capsys.readouterr().out,
    )


def test_one_side_given_is_that_side_and_the_other_the_pipelines_default(wan_folder, tmp_path, capsys, monkeypatch):
    """Only ``--height``: the height asked for, the width the pipeline's own default."""
    from optimum_iobinding import OnnxWanPipeline

    sizes = []
    call = OnnxWanPipeline.__call__
    monkeypatch.setattr(
        OnnxWanPipeline, "__call__", lambda self, **kw: sizes.append(kw) or call(self, **dict(kw, width=32))
    )
    argv = ["--provider", "CPUExecutionProvider", "--steps", "1", "--height", "16", "--frames", "5"]
    assert main(["generate", PROMPT, *argv, "--model", str(wan_folder), "--out", str(tmp_path / "f")]) == 0
    assert sizes[0]["height"] == 16 and "width" not in sizes[0]


def test_serve_refuses_a_video_folder_naming_its_model_argument_before_ray_starts(wan_folder, capsys, monkeypatch):
    pytest.importorskip("ray.serve")
    import optimum_iobinding.serve as serve
    from optimum_iobinding.families import family

    def started(*args, **kwargs):
        raise AssertionError("serve started Ray before it checked the folder")

    monkeypatch.setattr(serve, "run", started)
    assert main(["serve", str(wan_folder), "--device", "cpu"]) == 2
    record = family("wan")
    assert error_line(capsys) == (
        f"optimum-iobinding: error: model: expected a folder of a family that makes images, got a {record.title} "
        f"folder, whose calls make videos: use OnnxWanPipeline from Python"
    )


def test_a_replica_refuses_a_video_folder_by_its_model_before_loading_it(wan_folder, monkeypatch):
    pytest.importorskip("ray.serve")
    from dataclasses import asdict

    from optimum_iobinding import OnnxWanPipeline
    from optimum_iobinding.errors import ArgumentError
    from optimum_iobinding.serve import ImageGenerator, ServeConfig

    def loaded(*args, **kwargs):
        raise AssertionError("the replica loaded the video pipeline")

    monkeypatch.setattr(OnnxWanPipeline, "from_pretrained", loaded)
    config = ServeConfig(model=str(wan_folder), device="cpu", warmup_batch_sizes=[])
    with pytest.raises(ArgumentError) as refused:
        ImageGenerator(asdict(config))
    assert refused.value.argument == "model"
    assert "whose calls make videos: use OnnxWanPipeline from Python" in str(refused.value)
