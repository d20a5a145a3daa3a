"""The stream's stochastic similarity filter against StreamDiffusion's ``SimilarImageFilter``, written out here (its
rule, with the draws of ``random.Random(seed)``), on the tiny random SD pipeline, CPU execution provider: which frames
are skipped, what a skipped frame gives, a static clip against a moving one, and the refusals."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from .test_stream import PROMPT, SEED, SIZE, TOLERANCE, TURBO, frames_of, stream_for


class SimilarImageFilter:
    """StreamDiffusion's filter: keep the first frame; then, with ``s`` the cosine similarity of the frame and the last
    kept one, skip with probability ``max(0, 1 − (1 − s) / (1 − threshold))`` against ``uniform(0, 1)``; a frame that
    would be skipped while more than ``max_skip_frame`` skips have been counted is kept, and the count starts again."""

    def __init__(self, threshold, max_skip_frame, seed):
        self.threshold, self.max_skip_frame = threshold, max_skip_frame
        self.random = random.Random(seed)
        self.previous, self.skip_count = None, 0

    def __call__(self, x):
        if self.previous is None:
            self.previous = x.clone()
            return x
        similarity = torch.nn.CosineSimilarity(dim=0, eps=1e-6)(self.previous.reshape(-1), x.reshape(-1)).item()
        sample = self.random.uniform(0, 1)
        skip_probability = 0 if self.threshold >= 1 else max(0, 1 - (1 - similarity) / (1 - self.threshold))
        if skip_probability < sample:
            self.previous = x.clone()
            return x
        if self.skip_count > self.max_skip_frame:
            self.skip_count = 0
            self.previous = x.clone()
            return x
        self.skip_count += 1
        return None


def clip_of(count, change, seed=0):
    """``count`` frames in [-1, 1], each the one before plus noise of scale ``change``."""
    generator = torch.Generator().manual_seed(seed)
    frames = [torch.rand(3, SIZE, SIZE, generator=generator) * 2 - 1]
    for _ in range(count - 1):
        frames.append((frames[-1] + change * torch.randn(3, SIZE, SIZE, generator=generator)).clamp(-1, 1))
    return frames


def filtered_stream(folder, **kwargs):
    stream = stream_for(folder, TURBO)
    stream.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE, **kwargs)
    return stream


# similarities about 0.979 (change 0.12) and 0.996 (0.05): skip probabilities about 0.6, some skips drawn, some not
@pytest.mark.parametrize("threshold, max_skip_frame, change", [(0.95, 10, 0.12), (0.99, 2, 0.05)])
def test_skipped_frames_and_outputs_equal_streamdiffusions_filter(sd, threshold, max_skip_frame, change):
    frames = clip_of(24, change=change)
    stream = filtered_stream(sd[1], similarity_threshold=threshold, max_skip_frame=max_skip_frame)
    got = [stream(frame) for frame in frames]
    plain = filtered_stream(sd[1])
    reference, expected, last = SimilarImageFilter(threshold, max_skip_frame, SEED), [], None
    for frame in frames:
        kept = reference(frame[None]) is not None
        last = plain(frame) if kept else last
        expected.append(last)
    assert 0 < stream.skipped_frames < len(frames) - 1  # the clip makes the filter decide both ways
    for image, reference_image in zip(got, expected, strict=True):
        torch.testing.assert_close(image, reference_image, atol=TOLERANCE, rtol=0)


def test_a_static_clip_is_mostly_skipped_and_a_moving_one_not_at_all(sd):
    still = [frames_of(1)[0]] * 36
    stream = filtered_stream(sd[1], similarity_threshold=0.98, max_skip_frame=10)
    outputs = [stream(frame) for frame in still]
    # StreamDiffusion's rule: 11 skips, then a kept frame (past max_skip_frame), again and again
    kept = [index for index in range(1, len(still)) if not torch.equal(outputs[index], outputs[index - 1])]
    assert stream.skipped_frames == 33 and stream.skipped_frames / (len(still) - 1) >= 0.9
    assert all(torch.equal(output, outputs[0]) for output in outputs)  # the same frame gives the same output
    assert kept == []
    moving = clip_of(12, change=1.0, seed=4)
    stream = filtered_stream(sd[1], similarity_threshold=0.98, max_skip_frame=10)
    [stream(frame) for frame in moving]
    assert stream.skipped_frames == 0


def test_a_skipped_frame_gives_the_last_output_in_a_tensor_of_its_own(sd):
    stream = filtered_stream(sd[1], similarity_threshold=0.9)
    frame = frames_of(1)[0]
    first, second = stream(frame), stream(frame)
    assert stream.skipped_frames == 1
    assert torch.equal(first, second) and first.data_ptr() != second.data_ptr()
    held = np.array((frame / 2 + 0.5).clamp(0, 1).mul(255).round().byte().permute(1, 2, 0))
    out_a, out_b = stream(held), stream(held)  # another kind: kept, then skipped as that kind
    assert isinstance(out_b, np.ndarray) and np.array_equal(out_a, out_b) and not np.shares_memory(out_a, out_b)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(similarity_threshold=1.5), r"similarity_threshold: expected None or a number in \[0, 1\], got 1.5"),
        (dict(similarity_threshold="0.9"), r"similarity_threshold: expected None or a number in \[0, 1\], got '0.9'"),
        (dict(similarity_threshold=0.9, max_skip_frame=-1), r"max_skip_frame: expected an integer ≥ 0, got -1"),
    ],
)
def test_bad_filter_arguments_are_refused_by_name(sd, kwargs, match):
    stream = stream_for(sd[1], TURBO)
    with pytest.raises(ValueError, match=match):
        stream.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE, **kwargs)
    assert not stream.prepared
