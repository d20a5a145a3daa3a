"""Frames in and out (optimum_iobinding.video): video files and folders of images written and read back, sizes fitted
by scale-and-crop, atomic writing (a failure or an interruption leaves nothing, an existing target is kept unless
overwrite), no codec thread left behind by an early stop, and one named error for each kind of bad input. Small
frames, a few of them; the one GPU test (CUDA frames made on another stream) skips without CUDA."""

from __future__ import annotations

import gc
import os
import sys
import threading
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

av = pytest.importorskip("av", reason="needs the video extra (av)")

from optimum_iobinding.video import FrameWriter, natural_key, open_frames  # noqa: E402

WIDTH, HEIGHT = 64, 48
# what H.264 at CRF 0 gives back of smooth frames after the RGB -> yuv420p -> RGB round trip (measured ≤ 1.4 mean,
# 4 at most): well below the difference between two neighbouring test frames
LOSSY_MEAN_ERROR = 3.0

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch")


def smooth_frame(index: int, width: int = WIDTH, height: int = HEIGHT) -> np.ndarray:
    """A frame a codec keeps well (gentle gradients, no edges), different from its neighbours by ≥ 10 per pixel."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack(
        [40 + x * 2 + index * 10, 30 + y * 3 + index * 5, np.full_like(x, 200 - 20 * index)], axis=-1
    ).astype(np.uint8)


def write_video(path: Path, frames, fps=25, **kwargs) -> Path:
    with FrameWriter(path, fps=fps, **kwargs) as writer:
        for frame in frames:
            writer.write(frame)
    return path


def codec_threads():
    return [thread for thread in threading.enumerate() if thread.name.startswith("optimum-iobinding frame")]


def mean_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


@pytest.fixture
def frames():
    return [smooth_frame(index) for index in range(6)]


# ---------------------------------------------------------------------------------------------------- round trips
def test_a_video_written_and_read_back_has_its_frames_in_order_at_its_size_and_rate(tmp_path, frames):
    path = write_video(tmp_path / "clip.mp4", frames, fps=25, codec_options={"crf": "0"})
    reader = open_frames(path)
    assert (reader.kind, reader.fps, reader.frame_count, reader.size) == ("video", 25.0, 6, (WIDTH, HEIGHT))
    read = list(reader)
    assert len(read) == 6
    for index, frame in enumerate(read):
        assert frame.shape == (HEIGHT, WIDTH, 3) and frame.dtype == np.uint8
        errors = [mean_error(frame, source) for source in frames]
        assert errors[index] < LOSSY_MEAN_ERROR and int(np.argmin(errors)) == index


def test_a_webm_round_trip_keeps_the_frames_though_the_container_does_not_count_them(tmp_path, frames):
    reader = open_frames(write_video(tmp_path / "clip.webm", frames, codec_options={"lossless": "1", "crf": "0"}))
    assert reader.frame_count is None
    read = list(reader)
    assert len(read) == 6 and all(mean_error(a, b) < LOSSY_MEAN_ERROR for a, b in zip(read, frames))


def test_the_default_encoder_settings_keep_the_frames_close(tmp_path, frames):
    for name in ("clip.mp4", "clip.mkv", "clip.mov", "clip.webm"):
        read = list(open_frames(write_video(tmp_path / name, frames)))
        assert len(read) == 6 and all(mean_error(a, b) < 2 * LOSSY_MEAN_ERROR for a, b in zip(read, frames)), name


def test_an_ntsc_rate_read_back_as_a_float_is_written_again_exactly(tmp_path, frames):
    first = open_frames(write_video(tmp_path / "ntsc.mp4", frames[:2], fps=Fraction(30000, 1001)))
    again = write_video(tmp_path / "again.mp4", list(first), fps=first.fps)
    with av.open(str(again)) as container:
        assert container.streams.video[0].average_rate == Fraction(30000, 1001)


def test_a_folder_of_pngs_holds_every_frame_exactly_and_reads_back_in_order(tmp_path, frames):
    write_video(tmp_path / "out", frames)
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert sorted(os.listdir(tmp_path / "out")) == [f"{index:06d}.png" for index in range(6)]
    reader = open_frames(tmp_path / "out")
    assert (reader.kind, reader.fps, reader.frame_count, reader.size) == ("images", None, 6, (WIDTH, HEIGHT))
    assert all(np.array_equal(a, b) for a, b in zip(reader, frames))


def test_a_folder_is_read_in_natural_order_and_other_files_are_ignored(tmp_path, frames):
    folder = tmp_path / "in"
    folder.mkdir()
    for index, name in zip((2, 0, 1), ("frame10.png", "frame1.png", "Frame2.jpeg")):
        Image.fromarray(frames[index]).save(folder / name, **({"quality": 100} if name.endswith("jpeg") else {}))
    (folder / "notes.txt").write_text("not a frame")
    (folder / "._frame1.png").write_bytes(b"a file system's metadata, not an image")
    (folder / "sub.png").mkdir()
    assert sorted(["frame10.png", "frame1.png", "Frame2.jpeg"], key=natural_key) == [
        "frame1.png",
        "Frame2.jpeg",
        "frame10.png",
    ]
    read = list(open_frames(folder))
    assert len(read) == 3
    assert np.array_equal(read[0], frames[0]) and np.array_equal(read[2], frames[2])
    assert mean_error(read[1], frames[1]) < LOSSY_MEAN_ERROR  # JPEG


def test_grey_and_transparent_images_are_read_as_rgb(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    Image.fromarray(np.full((8, 8), 100, np.uint8), "L").save(folder / "0.png")
    Image.fromarray(np.full((8, 8, 4), 200, np.uint8), "RGBA").save(folder / "1.png")
    read = list(open_frames(folder))
    assert [frame.shape for frame in read] == [(8, 8, 3)] * 2
    assert (read[0] == 100).all() and (read[1] == 200).all()


def test_reading_again_starts_from_the_first_frame(tmp_path, frames):
    reader = open_frames(write_video(tmp_path / "clip.mp4", frames[:3]))
    first, second = list(reader), list(reader)
    assert len(first) == len(second) == 3 and all(np.array_equal(a, b) for a, b in zip(first, second))


def banded_frame(width: int = 64, height: int = 32) -> np.ndarray:
    """Red, then a green band across the middle half of the width, then blue."""
    frame = np.zeros((height, width, 3), np.uint8)
    frame[:, : width // 4, 0] = 255
    frame[:, width // 4 : 3 * width // 4, 1] = 255
    frame[:, 3 * width // 4 :, 2] = 255
    return frame


@pytest.mark.parametrize("source", ["video", "images"])
def test_size_scales_each_frame_to_cover_it_and_crops_the_centre(tmp_path, source):
    # 64×32 fitted to 16×16: scaled to 32×16, the centre 16 columns kept, which are the green band
    path = tmp_path / ("clip.mp4" if source == "video" else "in")
    write_video(path, [banded_frame()] * 2, codec_options={"crf": "0"} if source == "video" else None)
    reader = open_frames(path, size=16)
    assert (reader.size, (reader.source_width, reader.source_height)) == ((16, 16), (64, 32))
    for frame in reader:
        assert frame.shape == (16, 16, 3)
        inner = frame[:, 2:-2].astype(int)  # the bicubic filter blends a pixel or two at the band's edges
        assert (inner[..., 1] > 200).all() and (inner[..., 0] < 60).all() and (inner[..., 2] < 60).all()


def test_size_as_width_and_height(tmp_path, frames):
    reader = open_frames(write_video(tmp_path / "in", frames[:2]), size=(32, 16))
    assert reader.size == (32, 16) and [frame.shape for frame in reader] == [(16, 32, 3)] * 2


def test_torch_and_pil_frames_are_written_like_the_numpy_frame(tmp_path, frames):
    frame = frames[0]
    as_float = torch.from_numpy(frame).permute(2, 0, 1).float() / 255
    variants = [frame, torch.from_numpy(frame), as_float, as_float[None], Image.fromarray(frame)]
    read = list(open_frames(write_video(tmp_path / "out", variants)))
    assert len(read) == len(variants) and all(np.array_equal(image, frame) for image in read)


def test_the_caller_may_reuse_its_buffer_once_a_frame_is_written(tmp_path, frames):
    buffer = frames[0].copy()
    with FrameWriter(tmp_path / "out", queue_frames=4) as writer:
        for source in frames:
            buffer[...] = source
            writer.write(buffer)
    assert all(np.array_equal(a, b) for a, b in zip(open_frames(tmp_path / "out"), frames))


# ------------------------------------------------------------------------------------------------- atomic writing
@pytest.mark.parametrize("name", ["clip.mp4", "out"])
def test_an_error_midway_leaves_nothing_behind(tmp_path, frames, name):
    with pytest.raises(RuntimeError, match="the producer failed"):
        with FrameWriter(tmp_path / name) as writer:
            for frame in frames[:3]:
                writer.write(frame)
            raise RuntimeError("the producer failed")
    assert os.listdir(tmp_path) == [] and codec_threads() == []


@pytest.mark.parametrize("name", ["clip.mp4", "out"])
def test_an_interruption_keeps_the_existing_target_even_with_overwrite(tmp_path, frames, name):
    target = tmp_path / name
    write_video(target, frames[:2])
    before = sorted(p.name for p in target.iterdir()) if target.is_dir() else target.read_bytes()
    with pytest.raises(KeyboardInterrupt):
        with FrameWriter(target, overwrite=True) as writer:
            writer.write(frames[3])
            raise KeyboardInterrupt
    after = sorted(p.name for p in target.iterdir()) if target.is_dir() else target.read_bytes()
    assert after == before and os.listdir(tmp_path) == [name]
    assert len(list(open_frames(target))) == 2


def test_an_existing_file_is_refused_before_any_work_without_overwrite(tmp_path, frames):
    target = tmp_path / "clip.mp4"
    target.write_bytes(b"keep me")
    expected = r"path: expected a new file, got the existing file .*clip\.mp4.*overwrite=True"
    with pytest.raises(FileExistsError, match=expected):
        FrameWriter(target)
    assert target.read_bytes() == b"keep me" and os.listdir(tmp_path) == ["clip.mp4"]


def test_an_existing_folder_with_files_is_refused_without_overwrite(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="path: expected a new or empty folder.*mine.txt"):
        FrameWriter(tmp_path / "out")
    assert os.listdir(tmp_path / "out") == ["mine.txt"]


@pytest.mark.parametrize("name", ["clip.mp4", "out"])
def test_overwrite_replaces_the_target_once_the_new_one_is_whole(tmp_path, frames, name):
    write_video(tmp_path / name, frames[:2])
    write_video(tmp_path / name, frames[:5], overwrite=True)
    assert len(list(open_frames(tmp_path / name))) == 5 and os.listdir(tmp_path) == [name]


def test_the_result_gets_the_permissions_of_the_users_umask(tmp_path, frames):
    umask = os.umask(0o022)
    try:
        write_video(tmp_path / "clip.mp4", frames[:1])
        write_video(tmp_path / "out", frames[:1])
    finally:
        os.umask(umask)
    assert (tmp_path / "clip.mp4").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755


def test_an_encoder_failure_is_raised_naming_the_file_and_leaves_nothing(tmp_path, frames):
    with pytest.raises(RuntimeError, match=r"path: writing .*clip\.mp4' failed at frame 0: .*nothing was written"):
        write_video(tmp_path / "clip.mp4", frames, codec_options={"crf": "not a number"})
    assert os.listdir(tmp_path) == [] and codec_threads() == []


def test_a_frame_of_another_size_midway_is_refused_and_leaves_nothing(tmp_path, frames):
    expected = r"frame: expected every frame at the first one's size 64×48, got 32×48 \(frame 2"
    with pytest.raises(ValueError, match=expected):
        write_video(tmp_path / "clip.mp4", [frames[0], frames[1], frames[2][:, :32]])
    assert os.listdir(tmp_path) == []


def test_closing_without_frames_writes_nothing(tmp_path):
    with pytest.raises(ValueError, match=r"path: expected at least one frame for .*clip\.mp4', got none"):
        write_video(tmp_path / "clip.mp4", [])
    assert os.listdir(tmp_path) == []


def test_a_closed_writer_refuses_more_frames(tmp_path, frames):
    writer = FrameWriter(tmp_path / "out")
    writer.write(frames[0])
    assert writer.close() == tmp_path / "out"
    with pytest.raises(RuntimeError, match="is closed"):
        writer.write(frames[1])


def test_a_missing_parent_folder_is_made(tmp_path, frames):
    write_video(tmp_path / "a" / "b" / "clip.mp4", frames[:1])
    assert len(list(open_frames(tmp_path / "a" / "b" / "clip.mp4"))) == 1


# ----------------------------------------------------------------------------------------------------- threads
def test_breaking_out_of_a_read_stops_the_decoding_thread(tmp_path, frames):
    reader = open_frames(write_video(tmp_path / "clip.mp4", frames), queue_frames=1)
    for index, _ in enumerate(reader):
        assert len(codec_threads()) == 1
        if index == 1:
            break
    assert codec_threads() == []


def test_leaving_a_with_block_midway_stops_the_decoding_thread(tmp_path, frames):
    with open_frames(write_video(tmp_path / "in", frames), queue_frames=1) as reader:
        iterator = iter(reader)
        next(iterator)
        assert len(codec_threads()) == 1
    assert codec_threads() == []


def test_an_exception_in_the_consumer_stops_the_decoding_thread(tmp_path, frames):
    reader = open_frames(write_video(tmp_path / "clip.mp4", frames), queue_frames=1)
    with pytest.raises(ZeroDivisionError):
        for _ in reader:
            1 / 0
    assert codec_threads() == []


def test_a_whole_read_and_write_leave_no_thread(tmp_path, frames):
    write_video(tmp_path / "clip.mp4", frames)
    assert len(list(open_frames(tmp_path / "clip.mp4"))) == 6
    assert codec_threads() == []


def test_an_abandoned_writer_leaves_no_thread_and_no_scratch(tmp_path, frames):
    writer = FrameWriter(tmp_path / "clip.mp4")
    writer.write(frames[0])
    assert len(codec_threads()) == 1 and len(os.listdir(tmp_path)) == 1  # the hidden scratch folder
    del writer
    gc.collect()
    assert codec_threads() == [] and os.listdir(tmp_path) == []


def test_the_decoder_runs_no_further_ahead_than_its_queue(tmp_path, frames):
    folder = write_video(tmp_path / "in", frames + frames[:2])
    iterator = iter(open_frames(folder, queue_frames=1))
    assert np.array_equal(next(iterator), frames[0])
    # at most one frame waits in the queue and one in the decoder's hand: the last image has not been read yet, so
    # removing it now is seen when its turn comes
    (folder / "000007.png").unlink()
    with pytest.raises(ValueError, match=r"000007\.png"):
        list(iterator)
    assert codec_threads() == []


# ------------------------------------------------------------------------------------------------- bad input
def test_a_missing_input_is_named(tmp_path):
    expected = r"INPUT: expected a video file or a folder of images, got .*nope\.mp4': no such file or folder"
    with pytest.raises(FileNotFoundError, match=expected):
        open_frames(tmp_path / "nope.mp4", argument="INPUT")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads every file")
def test_an_unreadable_input_is_named(tmp_path, frames):
    path = write_video(tmp_path / "clip.mp4", frames[:1])
    path.chmod(0)
    try:
        with pytest.raises(PermissionError, match=r"path: expected a readable .*clip\.mp4'"):
            open_frames(path)
    finally:
        path.chmod(0o644)


def test_a_file_that_is_not_a_video_is_named(tmp_path):
    (tmp_path / "clip.mp4").write_text("this is text, not a video")
    expected = (
        r"path: expected a video file or a folder of images, got .*clip\.mp4', which FFmpeg cannot read as a "
        "video"
    )
    with pytest.raises(ValueError, match=expected):
        open_frames(tmp_path / "clip.mp4")


def test_a_file_without_a_video_stream_is_named(tmp_path):
    path = tmp_path / "sound.wav"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    with pytest.raises(ValueError, match=r"sound\.wav', a wav file with no video stream \(it holds: audio\)"):
        open_frames(path)


def test_a_video_without_frames_is_named(tmp_path):
    path = tmp_path / "empty.mkv"
    container = av.open(str(path), "w")
    stream = container.add_stream("libx264", rate=25)
    stream.width, stream.height = WIDTH, HEIGHT
    container.start_encoding()
    container.close()
    with pytest.raises(ValueError, match=r"empty\.mkv', a video with no frames"):
        open_frames(path)


def test_a_folder_without_images_is_named(tmp_path):
    (tmp_path / "notes.txt").write_text("no frames here")
    with pytest.raises(ValueError, match=r"got the folder .* with no frames: 1 entry, none of them an image"):
        open_frames(tmp_path)


def test_a_broken_image_is_named(tmp_path, frames):
    Image.fromarray(frames[0]).save(tmp_path / "0.png")
    (tmp_path / "1.png").write_bytes(b"not a png")
    reader = open_frames(tmp_path)
    with pytest.raises(ValueError, match=r"path: expected an image PIL can read, got .*1\.png'"):
        list(reader)
    assert codec_threads() == []


def test_images_of_another_size_are_named_unless_a_size_is_given(tmp_path, frames):
    Image.fromarray(frames[0]).save(tmp_path / "0.png")
    Image.fromarray(frames[1][:32]).save(tmp_path / "1.png")
    expected = r"at the first one's size 64×48, got 64×32 at frame 1 \(1\.png\); pass size="
    with pytest.raises(ValueError, match=expected):
        list(open_frames(tmp_path))
    assert [frame.shape for frame in open_frames(tmp_path, size=16)] == [(16, 16, 3)] * 2


@pytest.mark.parametrize("size", [0, -4, (16,), (16, 0), "512", 16.0, (True, 16)])
def test_a_bad_size_is_named(tmp_path, frames, size):
    write_video(tmp_path / "in", frames[:1])
    with pytest.raises(ValueError, match="size: expected a positive int"):
        open_frames(tmp_path / "in", size=size)


def test_an_odd_size_is_refused_for_a_video_with_the_reason_and_taken_by_a_folder(tmp_path):
    odd = smooth_frame(0, width=31, height=20)
    expected = r"frame: expected an even width and height for .*clip\.mp4' .*yuv420p.*got 31×20"
    with pytest.raises(ValueError, match=expected):
        write_video(tmp_path / "clip.mp4", [odd])
    assert os.listdir(tmp_path) == []
    assert np.array_equal(next(iter(open_frames(write_video(tmp_path / "out", [odd])))), odd)


@pytest.mark.parametrize("name", ["clip.avi", "frame.png", "clip."])
def test_an_unsupported_output_extension_is_named(tmp_path, name):
    with pytest.raises(ValueError, match=r"OUTPUT: expected a video file \(\.mp4, \.mkv, \.mov, \.webm\) or a folder"):
        FrameWriter(tmp_path / name if not name.endswith(".") else str(tmp_path / name), argument="OUTPUT")


@pytest.mark.parametrize("fps", [0, -1, float("nan"), float("inf"), "30", True])
def test_a_bad_rate_is_named(tmp_path, fps):
    with pytest.raises(ValueError, match="fps: expected a positive finite number"):
        FrameWriter(tmp_path / "clip.mp4", fps=fps)


@pytest.mark.parametrize(
    "frame, expected",
    [
        (
            np.zeros((8, 8, 3), np.float32),
            r"expected \(height, width, 3\) uint8 RGB, got shape \(8, 8, 3\) float32 .*; a float image in \[0, 1\]",
        ),
        (np.zeros((8, 8), np.uint8), r"got shape \(8, 8\) uint8 .*; a grayscale \(height, width\) one with np.stack"),
        (np.zeros((8, 8, 4), np.uint8), r"got shape \(8, 8, 4\) uint8 \(frame 0 of '[^']*'\)$"),
        (torch.zeros(8, 8, 3), r"expected a float tensor \(3, height, width\).* got shape \(8, 8, 3\)"),
        (torch.zeros(8, 8, 3, dtype=torch.int32), r"got torch.int32"),
        ([[0, 0, 0]], r"frame: expected a numpy array, a torch tensor or a PIL image, got list"),
    ],
)
def test_a_frame_of_the_wrong_kind_is_named(tmp_path, frame, expected):
    writer = FrameWriter(tmp_path / "out")
    with pytest.raises((ValueError, TypeError), match=expected):
        writer.write(frame)
    writer.abort()
    assert os.listdir(tmp_path) == []


def test_bad_codec_options_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"codec_options: expected a dict of FFmpeg option names to string values"):
        FrameWriter(tmp_path / "clip.mp4", codec_options={"crf": 18})
    with pytest.raises(ValueError, match=r"codec_options: expected none for a folder of PNGs"):
        FrameWriter(tmp_path / "out", codec_options={"crf": "18"})


def test_a_video_path_that_is_a_folder_or_below_a_file_is_named(tmp_path):
    (tmp_path / "clip.mp4").mkdir()
    with pytest.raises(IsADirectoryError, match=r"path: expected a video file name, got the folder"):
        FrameWriter(tmp_path / "clip.mp4", overwrite=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match=r"file' is not a folder"):
        FrameWriter(tmp_path / "file" / "clip.mp4")


def test_without_pyav_video_needs_the_extra_and_folders_still_work(tmp_path, frames, monkeypatch):
    write_video(tmp_path / "in", frames[:1])
    monkeypatch.setitem(sys.modules, "av", None)  # what an environment without PyAV imports
    expected = r"path: writing the video .*clip\.mp4' needs PyAV.*optimum-iobinding\[video\]"
    with pytest.raises(ImportError, match=expected):
        FrameWriter(tmp_path / "clip.mp4")
    assert len(list(open_frames(tmp_path / "in"))) == 1
    write_video(tmp_path / "out", frames[:1])


# ---------------------------------------------------------------------------------------------------------- GPU
@requires_cuda
def test_cuda_frames_made_on_another_stream_are_written_once_ready(tmp_path, frames):
    side = torch.cuda.Stream()
    expected = []
    with torch.cuda.stream(side), FrameWriter(tmp_path / "out") as writer:
        busy = torch.randn(2048, 2048, device="cuda")
        for index, frame in enumerate(frames):
            for _ in range(20):  # work queued ahead of the frame, so that a copy not ordered after it reads too early
                busy = torch.tanh(busy @ busy)
            image = torch.from_numpy(frame).to("cuda").permute(2, 0, 1).float() / 255
            image = image + busy.mean() * 0  # the frame depends on the work above
            writer.write(image if index % 2 else (image * 255).round().to(torch.uint8).permute(1, 2, 0))
            expected.append(frame)
    assert all(np.array_equal(a, b) for a, b in zip(open_frames(tmp_path / "out"), expected))
