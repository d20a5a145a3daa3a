"""``optimum-iobinding stream INPUT OUTPUT``: every frame of a video or a folder of images through the stream pipeline
on the tiny random model (CPU), written to a video or a folder of PNGs; the same frames as the pipeline run directly;
every bad input refused in one line before any model loads, and no output left half written."""

from __future__ import annotations

import importlib.util
import os
import re

import numpy as np
import pytest
from PIL import Image

from optimum_iobinding import OnnxStreamDiffusionPipeline
from optimum_iobinding.cli import main
from optimum_iobinding.video import FrameWriter, open_frames
from tests.commands import error_line

requires_av = pytest.mark.skipif(importlib.util.find_spec("av") is None, reason="needs the video extra (av)")

SIZE = 64
FRAMES = 4
PROMPT = "a watercolor landscape"


def sketch(index: int, width: int = SIZE, height: int = SIZE) -> np.ndarray:
    """A frame of a smooth moving pattern (compresses well, so a video's frames stay close to the originals)."""
    y, x = np.mgrid[0:height, 0:width]
    phase = index / 3.0
    channels = [np.sin(x / 9.0 + phase), np.cos(y / 7.0 - phase), np.sin((x + y) / 11.0 + phase)]
    return np.ascontiguousarray(((np.stack(channels, axis=-1) + 1) * 127.5).astype(np.uint8))


def write_frames(path, count=FRAMES, width=SIZE, height=SIZE, fps=12, same=False):
    with FrameWriter(path, fps=fps) as writer:
        for index in range(count):
            writer.write(sketch(0 if same else index, width, height))
    return path


def read_all(path):
    with open_frames(path) as reader:
        return reader, list(reader)


@pytest.fixture(scope="module")
def tiny_vae(vae_folder):
    """A folder of a tiny random AutoencoderTiny's export alone (vae_encoder/ and vae_decoder/)."""
    return vae_folder


@pytest.fixture
def image_folder(tmp_path):
    return write_frames(tmp_path / "frames")


def stream_directly(folder, frames, tiny_vae=None, steps=2, strength=0.5, stream_batch=True, seed=0, **guidance):
    stream = OnnxStreamDiffusionPipeline.from_pretrained(folder, provider="CPUExecutionProvider", tiny_vae=tiny_vae)
    stream.prepare(
        PROMPT,
        num_inference_steps=steps,
        strength=strength,
        guidance_scale=guidance.pop("guidance_scale", 0.0),
        seed=seed,
        height=SIZE,
        width=SIZE,
        stream_batch=stream_batch,
        **guidance,
    )
    return list(stream.frames(frames))


def run_stream(source, target, model, *options):
    return main(
        [
            "stream",
            str(source),
            str(target),
            "--prompt",
            PROMPT,
            "--model",
            str(model),
            "--provider",
            "CPUExecutionProvider",
            *options,
        ]
    )


# ------------------------------------------------------------------------------------------------ what it makes
@requires_av
def test_a_video_in_gives_a_video_of_as_many_frames_of_the_same_size_and_rate(tmp_path, tiny_folder, capsys):
    source = write_frames(tmp_path / "in.mp4", fps=12)
    assert run_stream(source, tmp_path / "out.mp4", tiny_folder) == 0
    reader, frames = read_all(tmp_path / "out.mp4")
    assert len(frames) == FRAMES
    assert reader.size == (SIZE, SIZE)
    assert reader.fps == pytest.approx(12)


@pytest.mark.parametrize(
    "options, steps, stream_batch",
    [
        ((), 2, True),
        (("--steps", "4"), 4, True),
        (("--steps", "4", "--no-stream-batch"), 4, False),
    ],
    ids=["one-step", "two-steps-stream-batch", "two-steps-in-turn"],
)
def test_an_image_folder_in_gives_the_frames_of_the_pipeline_run_directly(
    tmp_path, tiny_folder, image_folder, options, steps, stream_batch
):
    assert run_stream(image_folder, tmp_path / "out", tiny_folder, *options) == 0
    _, inputs = read_all(image_folder)
    _, outputs = read_all(tmp_path / "out")
    expected = stream_directly(tiny_folder, inputs, steps=steps, stream_batch=stream_batch)
    assert sorted(os.listdir(tmp_path / "out")) == [f"{index:06d}.png" for index in range(FRAMES)]
    assert len(outputs) == len(expected) == FRAMES
    for output, reference in zip(outputs, expected):
        np.testing.assert_array_equal(output, reference)
    assert not np.array_equal(outputs[0], inputs[0])  # the model changed the frames


def test_the_tiny_vae_replaces_the_models_vae(tmp_path, tiny_folder, image_folder, tiny_vae):
    assert run_stream(image_folder, tmp_path / "out", tiny_folder, "--tiny-vae", str(tiny_vae)) == 0
    _, inputs = read_all(image_folder)
    _, outputs = read_all(tmp_path / "out")
    for output, reference in zip(outputs, stream_directly(tiny_folder, inputs, tiny_vae=tiny_vae), strict=True):
        np.testing.assert_array_equal(output, reference)
    full_vae = stream_directly(tiny_folder, inputs)
    assert not np.array_equal(outputs[0], full_vae[0])


def test_an_sdxl_folder_streams_through_the_sdxl_stream(tmp_path, xl_folder, image_folder):
    from optimum_iobinding import OnnxStreamDiffusionXLPipeline

    assert run_stream(image_folder, tmp_path / "out", xl_folder) == 0
    _, inputs = read_all(image_folder)
    _, outputs = read_all(tmp_path / "out")
    stream = OnnxStreamDiffusionPipeline.from_pretrained(xl_folder, provider="CPUExecutionProvider")
    assert type(stream) is OnnxStreamDiffusionXLPipeline
    for output, reference in zip(outputs, stream_directly(xl_folder, inputs), strict=True):
        np.testing.assert_array_equal(output, reference)


def test_a_controlnet_folder_streams_with_the_control_image_and_scale_given(tmp_path, controlnet_folders, image_folder):
    from PIL import Image

    control = Image.fromarray(sketch(9))
    control.save(tmp_path / "edges.png")
    folder = controlnet_folders["one"]
    options = ("--control-image", str(tmp_path / "edges.png"), "--control-scale", "0.6")
    assert run_stream(image_folder, tmp_path / "out", folder, *options) == 0
    _, inputs = read_all(image_folder)
    _, outputs = read_all(tmp_path / "out")
    expected = stream_directly(folder, inputs, control_image=control, controlnet_conditioning_scale=0.6)
    for output, reference in zip(outputs, expected, strict=True):
        np.testing.assert_array_equal(output, reference)
    other_scale = stream_directly(folder, inputs, control_image=control, controlnet_conditioning_scale=1.5)
    assert not np.array_equal(outputs[0], other_scale[0])


@pytest.mark.parametrize(
    "model, options, message",
    [
        ("controlnet", (), "--control-image: expected 1 control image(s) for the model's 1 ControlNet(s)"),
        (
            "plain",
            ("--control-image", "{tmp}/edges.png"),
            "--control-image: expected a model exported with a ControlNet",
        ),
        ("controlnet", ("--control-scale", "0.5"), "--control-scale: expected it with --control-image"),
        ("controlnet", ("--control-image", "{tmp}/missing.png"), "--control-image: expected an image file"),
        ("controlnet", ("--control-image", "{tmp}/edges.png") * 2, "--control-image: expected 1 (one per ControlNet"),
        (
            "two",
            ("--control-image", "{tmp}/edges.png") * 2 + ("--control-scale", "1") * 3,
            "--control-scale: expected 1 or 2 values",
        ),
    ],
    ids=["no-control-image", "no-controlnet", "scale-alone", "missing-file", "images-per-net", "scales-per-net"],
)
def test_control_options_are_refused_by_name_before_any_frame(
    tmp_path, tiny_folder, controlnet_folders, image_folder, capsys, model, options, message
):
    from PIL import Image

    Image.fromarray(sketch(9)).save(tmp_path / "edges.png")
    folder = {"controlnet": controlnet_folders["one"], "two": controlnet_folders["two"]}.get(model, tiny_folder)
    options = [option.replace("{tmp}", str(tmp_path)) for option in options]
    assert run_stream(image_folder, tmp_path / "out", folder, *options) == 2
    assert message in error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_the_seed_strength_and_prompt_reach_the_pipeline(tmp_path, tiny_folder, image_folder):
    assert run_stream(image_folder, tmp_path / "out", tiny_folder, "--seed", "7", "--strength", "0.75") == 0
    _, inputs = read_all(image_folder)
    _, outputs = read_all(tmp_path / "out")
    for output, reference in zip(outputs, stream_directly(tiny_folder, inputs, strength=0.75, seed=7), strict=True):
        np.testing.assert_array_equal(output, reference)


def test_residual_guidance_reaches_the_pipeline(tmp_path, tiny_folder, image_folder):
    options = ("--guidance", "1.5", "--cfg-type", "self", "--delta", "0.5")
    assert run_stream(image_folder, tmp_path / "out", tiny_folder, *options) == 0
    _, inputs = read_all(image_folder)
    _, outputs = read_all(tmp_path / "out")
    expected = stream_directly(tiny_folder, inputs, guidance_scale=1.5, cfg_type="self", delta=0.5)
    for output, reference in zip(outputs, expected, strict=True):
        np.testing.assert_array_equal(output, reference)
    unguided = stream_directly(tiny_folder, inputs)
    assert any(not np.array_equal(output, reference) for output, reference in zip(outputs, unguided))


def test_the_similarity_filter_reaches_the_pipeline(tmp_path, tiny_folder, capsys):
    still = write_frames(tmp_path / "still", count=4, same=True)
    assert run_stream(still, tmp_path / "out", tiny_folder, "--similarity-threshold", "0.98") == 0
    # the tiny model runs 2 steps in a stream batch: the first two frames fill it (no output to give again yet), the
    # next two are skipped
    assert "; 2 frames skipped by the similarity filter)" in capsys.readouterr().out
    _, inputs = read_all(still)
    _, outputs = read_all(tmp_path / "out")
    expected = stream_directly(tiny_folder, inputs, similarity_threshold=0.98)
    assert len(outputs) == len(inputs) == 4
    for output, reference in zip(outputs, expected, strict=True):
        np.testing.assert_array_equal(output, reference)


def test_size_fits_every_frame_to_one_size(tmp_path, tiny_folder):
    source = write_frames(tmp_path / "wide", count=2, width=96, height=72)
    assert run_stream(source, tmp_path / "out", tiny_folder, "--size", "64x48") == 0
    reader, outputs = read_all(tmp_path / "out")
    assert reader.size == (64, 48) and len(outputs) == 2


def test_without_a_model_the_tiny_random_model_is_used(tmp_path, tiny_folder, image_folder, capsys):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tiny-random-sd").symlink_to(tiny_folder)  # what tiny_model_folder builds there once
    assert (
        main(
            [
                "stream",
                str(image_folder),
                str(tmp_path / "out"),
                "--prompt",
                PROMPT,
                "--cache-dir",
                str(cache),
                "--provider",
                "CPUExecutionProvider",
            ]
        )
        == 0
    )
    _, inputs = read_all(image_folder)
    _, outputs = read_all(tmp_path / "out")
    for output, reference in zip(outputs, stream_directly(tiny_folder, inputs), strict=True):
        np.testing.assert_array_equal(output, reference)


def test_the_summary_line_gives_frames_seconds_and_frames_per_second(tmp_path, tiny_folder, image_folder, capsys):
    assert run_stream(image_folder, tmp_path / "out", tiny_folder) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    assert re.match(rf".*out: {FRAMES} frames of {SIZE}×{SIZE} in [0-9.]+ s \([0-9.]+ frames/s;", lines[0])


def test_an_existing_output_is_kept_without_overwrite_and_replaced_with_it(tmp_path, tiny_folder, image_folder, capsys):
    target = tmp_path / "out"
    target.mkdir()
    (target / "mine.txt").write_text("keep me")
    assert run_stream(image_folder, target, tiny_folder) == 2
    line = error_line(capsys)
    assert "OUTPUT: expected a new or empty folder" in line
    assert "pass --overwrite to replace it" in line and "overwrite=True" not in line  # the command's own words
    assert os.listdir(target) == ["mine.txt"]
    assert run_stream(image_folder, target, tiny_folder, "--overwrite") == 0
    assert sorted(os.listdir(target)) == [f"{index:06d}.png" for index in range(FRAMES)]


def test_a_frame_that_fails_midway_leaves_no_output(tmp_path, tiny_folder, capsys):
    source = write_frames(tmp_path / "frames", count=3)
    Image.fromarray(sketch(3, 72, 64)).save(source / "000003.png")  # the last frame of another size
    assert run_stream(source, tmp_path / "out", tiny_folder) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar
    assert last.startswith("optimum-iobinding: error: INPUT: expected every frame of"), last
    assert last.endswith("; pass --size to fit every frame to one size") and "size=" not in last, last
    assert sorted(os.listdir(tmp_path)) == ["frames"]  # neither the output nor a partial one


# ----------------------------------------------------------------------------------------------- bad input
def bad_inputs(tmp_path):
    """Each case: (INPUT, OUTPUT, extra options); made in tmp_path."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "garbage.mp4").write_bytes(b"this is not a video")
    write_frames(tmp_path / "frames", count=2)
    (tmp_path / "no-vae").mkdir()
    (tmp_path / "half-taesd" / "vae_encoder").mkdir(parents=True)
    (tmp_path / "half-taesd" / "vae_encoder" / "model.onnx").write_bytes(b"")
    (tmp_path / "existing.mp4").write_bytes(b"mine")
    for part in ("vae_encoder", "vae_decoder"):  # a full VAE's export (AutoencoderKL), not a tiny one
        (tmp_path / "full-vae" / part).mkdir(parents=True)
        (tmp_path / "full-vae" / part / "model.onnx").write_bytes(b"")
        (tmp_path / "full-vae" / part / "config.json").write_text('{"_class_name": "AutoencoderKL"}')
    (tmp_path / "dit" / "transformer").mkdir(parents=True)  # an SD3 or FLUX.1 folder
    (tmp_path / "dit" / "transformer" / "model.onnx").write_bytes(b"")
    model = tmp_path / "model"  # what the stream's folder check asks of a local --model
    for part in ("text_encoder", "unet", "vae_encoder", "vae_decoder"):
        (model / part).mkdir(parents=True)
        (model / part / "model.onnx").write_bytes(b"")
    (model / "tokenizer").mkdir()
    (model / "model_index.json").write_text("{}")
    frames = tmp_path / "frames"
    return {
        "missing": (
            tmp_path / "nothing.mp4",
            tmp_path / "out",
            (),
            r"INPUT: expected a video file or a folder of "
            r"images, got .*nothing\.mp4.*no such file",
        ),
        "unreadable": (
            tmp_path / "garbage.mp4",
            tmp_path / "out",
            (),
            r"INPUT: expected a video file or a folder "
            r"of images, got .*garbage\.mp4",
        ),
        "no-frames": (
            tmp_path / "empty",
            tmp_path / "out",
            (),
            r"INPUT: expected a video file or a folder holding "
            r"images .* with no frames",
        ),
        "size-text": (frames, tmp_path / "out", ("--size", "big"), r"--size: expected pixels as 512 or 768x512"),
        "steps": (frames, tmp_path / "out", ("--steps", "0"), r"--steps: expected a positive integer, got 0"),
        "strength": (frames, tmp_path / "out", ("--strength", "1.5"), r"--strength: expected a number in \(0, 1\]"),
        "guidance": (frames, tmp_path / "out", ("--guidance", "nan"), r"--guidance: expected a finite number"),
        "delta": (frames, tmp_path / "out", ("--delta", "inf"), r"--delta: expected a finite number"),
        "similarity-threshold": (
            frames,
            tmp_path / "out",
            ("--similarity-threshold", "2"),
            r"--similarity-threshold: expected a number in \[0, 1\]",
        ),
        "max-skip-frame": (
            frames,
            tmp_path / "out",
            ("--max-skip-frame", "-1"),
            r"--max-skip-frame: expected an integer",
        ),
        "seed": (frames, tmp_path / "out", ("--seed", "-1"), r"--seed: expected an integer in 0 …"),
        "model-of-a-transformer": (
            frames,
            tmp_path / "out",
            ("--model", str(tmp_path / "dit")),
            r"--model: expected a UNet folder \(SD 1.x/2.x, SD-Turbo, LCM, SDXL: the stream runs UNets\), got .*dit.*, a "
            r"diffusion transformer's \(SD3, FLUX.1\), which no stream runs",
        ),
        "negative-prompt-unguided": (
            frames,
            tmp_path / "out",
            ("--negative-prompt", "blur"),
            r"--negative-prompt: expected it with --guidance above 1 and --cfg-type full or initialize \(the guidance "
            r"that runs it\), got --guidance 0 and --cfg-type full",
        ),
        "model-without-vae": (
            frames,
            tmp_path / "out",
            ("--model", str(tmp_path / "no-vae")),
            r"--model: expected an ONNX Stable Diffusion folder, got .*no-vae.* without "
            r"model_index\.json, text_encoder/model\.onnx, unet/model\.onnx, "
            r"vae_encoder/model\.onnx",
        ),
        "tiny-vae-without-decoder": (
            frames,
            tmp_path / "out",
            ("--tiny-vae", str(tmp_path / "half-taesd")),
            r"--tiny-vae: expected an AutoencoderTiny export holding vae_encoder/model\.onnx "
            r"and vae_decoder/model\.onnx, got .*half-taesd.* without "
            r"vae_decoder/model\.onnx",
        ),
        "tiny-vae-of-a-full-vae": (
            frames,
            tmp_path / "out",
            ("--tiny-vae", str(tmp_path / "full-vae")),
            r"--tiny-vae: expected an AutoencoderTiny export \(TAESD, made by optimum-iobinding export --tiny-vae\), "
            r"got .*full-vae.*, whose vae_encoder is an AutoencoderKL",
        ),
        "output-extension": (
            frames,
            tmp_path / "out.gif",
            (),
            r"OUTPUT: expected a video file \(\.mp4.*\) or a "
            r"folder for PNG frames",
        ),
        "output-is-input": (frames, frames, ("--overwrite",), r"OUTPUT: expected another path than INPUT"),
        "output-holds-input": (
            frames,
            tmp_path,
            ("--overwrite",),
            r"OUTPUT: expected a path apart from INPUT \(.*frames.*\), got .*, which holds it: writing OUTPUT would "
            r"replace what INPUT reads",
        ),
        "output-is-the-model": (
            frames,
            model,
            ("--model", str(model), "--overwrite"),
            r"OUTPUT: expected a path apart from --model \(.*model.*\), got .*, which is it",
        ),
        "output-in-a-folder-that-takes-no-file": (
            frames,
            "/proc/out.mp4",
            (),
            r"OUTPUT: expected a path in a writable folder, got '/proc/out\.mp4', but '/proc' takes no new file",
        ),
        "output-exists": (
            frames,
            tmp_path / "existing.mp4",
            (),
            r"OUTPUT: expected a new file, got the existing "
            r"file .*existing\.mp4",
        ),
        "provider": (
            frames,
            tmp_path / "out",
            ("--provider", "NoSuchExecutionProvider"),
            r"--provider: .NoSuchExecutionProvider. is not available",
        ),
    }


BAD_INPUTS = [
    "missing",
    "unreadable",
    "no-frames",
    "size-text",
    "steps",
    "strength",
    "guidance",
    "delta",
    "similarity-threshold",
    "max-skip-frame",
    "seed",
    "negative-prompt-unguided",
    "model-of-a-transformer",
    "model-without-vae",
    "tiny-vae-without-decoder",
    "tiny-vae-of-a-full-vae",
    "output-extension",
    "output-is-input",
    "output-holds-input",
    "output-is-the-model",
    "output-in-a-folder-that-takes-no-file",
    "output-exists",
    "provider",
]
NEEDS_AV = {"unreadable", "output-exists", "output-in-a-folder-that-takes-no-file"}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_status_2_before_any_model_loads(tmp_path, capsys, no_work, case):
    if case in NEEDS_AV and importlib.util.find_spec("av") is None:
        pytest.skip("needs the video extra (av)")
    source, target, options, message = bad_inputs(tmp_path)[case]
    before = sorted(os.listdir(tmp_path))
    assert main(["stream", str(source), str(target), "--prompt", PROMPT, *options]) == 2
    line = error_line(capsys)
    assert line.startswith("optimum-iobinding: error: ")
    assert re.search(message, line), line
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, nothing removed
    assert (tmp_path / "existing.mp4").read_bytes() == b"mine"


@pytest.mark.parametrize(
    "frame_size, options, message",
    [
        (
            (60, 64),
            (),
            r"INPUT: expected frames whose width and height are multiples of {multiple}, got 60×64 .*--size",
        ),
        (
            (64, 64),
            ("--size", "65"),
            r"--size: expected a width and height that are multiples of {multiple} .*got '65'",
        ),
    ],
    ids=["input", "size-option"],
)
def test_a_frame_size_the_model_cannot_run_is_refused_naming_the_option_and_the_models_multiple(
    tmp_path, tiny_folder, capsys, frame_size, options, message
):
    """The multiple is the model's (its ``size_multiple``), known once it is loaded; nothing is written."""
    multiple = OnnxStreamDiffusionPipeline.from_pretrained(tiny_folder, provider="CPUExecutionProvider").size_multiple
    source = write_frames(tmp_path / "frames", count=2, width=frame_size[0], height=frame_size[1])
    assert run_stream(source, tmp_path / "out", tiny_folder, *options) == 2
    assert re.search(message.format(multiple=multiple), error_line(capsys))
    assert sorted(os.listdir(tmp_path)) == ["frames"]


@pytest.mark.parametrize("output", [".", ".."])
def test_the_working_folder_or_one_holding_it_is_refused_as_output_even_with_overwrite(
    tmp_path, capsys, no_work, monkeypatch, output
):
    source = write_frames(tmp_path / "in", count=1)
    work = tmp_path / "work" / "here"
    work.mkdir(parents=True)
    (work / "mine.txt").write_text("mine")
    monkeypatch.chdir(work)
    assert main(["stream", str(source), output, "--prompt", PROMPT, "--overwrite"]) == 2
    assert re.search(
        rf"OUTPUT: expected a folder apart from the working folder .*, got '{re.escape(output)}'", error_line(capsys)
    )
    assert os.listdir(work) == ["mine.txt"] and sorted(os.listdir(tmp_path)) == ["in", "work"]


def test_a_prompt_is_required(capsys, no_work, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["stream", str(tmp_path), str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "--prompt" in capsys.readouterr().err


def test_the_stream_command_prints_its_help(capsys, no_work):
    with pytest.raises(SystemExit) as exit_info:
        main(["stream", "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: optimum-iobinding stream")


# ------------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize(
    "options",
    [(), ("--steps", "4"), ("--steps", "4", "--no-stream-batch")],
    ids=["one-step", "two-steps-stream-batch", "two-steps-in-turn"],
)
def test_on_cuda_the_command_gives_the_frames_of_the_pipeline_run_directly(
    tmp_path, tiny_folder, image_folder, tiny_vae, options
):
    assert (
        main(
            [
                "stream",
                str(image_folder),
                str(tmp_path / "out"),
                "--prompt",
                PROMPT,
                "--model",
                str(tiny_folder),
                "--tiny-vae",
                str(tiny_vae),
                "--provider",
                "CUDAExecutionProvider",
                *options,
            ]
        )
        == 0
    )
    _, inputs = read_all(image_folder)
    _, outputs = read_all(tmp_path / "out")
    stream = OnnxStreamDiffusionPipeline.from_pretrained(
        tiny_folder, provider="CUDAExecutionProvider", tiny_vae=tiny_vae
    )
    steps = 4 if "4" in options else 2
    stream.prepare(
        PROMPT,
        num_inference_steps=steps,
        strength=0.5,
        guidance_scale=0.0,
        seed=0,
        height=SIZE,
        width=SIZE,
        stream_batch="--no-stream-batch" not in options,
    )
    expected = list(stream.frames(inputs))
    assert len(outputs) == len(expected) == FRAMES
    for output, reference in zip(outputs, expected):
        np.testing.assert_array_equal(output, reference)


def test_a_frame_size_beyond_the_hosts_memory_is_refused_before_the_model_loads(tmp_path, tiny_folder, capsys, no_work):
    """``--size`` is checked against the memory its call would need (the host's, on the CPU) before loading."""
    source = write_frames(tmp_path / "frames", count=1)
    assert run_stream(source, tmp_path / "out", tiny_folder, "--size", "1000000") == 2
    assert re.match(
        r"optimum-iobinding: error: --size: 1000000×1000000 needs about \d{1,3}(,\d{3})+ TB at once for the VAE "
        r"decoder, "
        r"more than [0-9.]+ GB, the host's available memory; at most about \d+×\d+ fits$",
        error_line(capsys),
    )
    assert sorted(os.listdir(tmp_path)) == ["frames"]
