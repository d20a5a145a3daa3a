"""The size check asked of a folder before anything loads: the floor of what the VAE decoder's full-resolution
stage holds, against the memory the call would run in."""

from __future__ import annotations

import json
import re

import pytest

from optimum_iobinding.errors import ArgumentError
from optimum_iobinding.pipelines import memory


def decoder(tmp_path, config):
    folder = tmp_path / "vae_decoder"
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "config, channels",
    [
        ({"_class_name": "AutoencoderKL", "block_out_channels": [128, 256, 512, 512]}, 384),
        ({"_class_name": "AutoencoderKL", "block_out_channels": [32]}, 64),
        ({"_class_name": "AutoencoderTiny", "decoder_block_out_channels": [64, 64, 64, 64]}, 128),
        (None, memory.DEFAULT_FULL_RESOLUTION_CHANNELS),
        ({"block_out_channels": "not a list"}, memory.DEFAULT_FULL_RESOLUTION_CHANNELS),
    ],
    ids=["sd-vae", "one-stage", "tiny-vae", "no-config", "bad-config"],
)
def test_the_full_resolution_channels_come_from_the_decoders_config(tmp_path, config, channels):
    assert memory.full_resolution_channels(decoder(tmp_path, config)) == channels


@pytest.fixture
def host_with(monkeypatch):
    def host(free):
        monkeypatch.setattr(
            memory, "available_memory", lambda provider, device_id=0: (free, "the host's available memory")
        )

    return host


def test_a_size_beyond_the_memory_is_refused_with_a_size_that_fits_the_bound(tmp_path, host_with):
    folder = decoder(tmp_path, {"block_out_channels": [128, 256, 512, 512]})
    host_with(10**9)  # 1 GB: 1024×768 needs 1024·768·384·2 ≈ 0.60 GB, 2048×1536 four times that
    memory.check_image_fits(folder, 1024, 768, "CPUExecutionProvider")
    with pytest.raises(ArgumentError) as refused:
        memory.check_image_fits(folder, 2048, 1536, "CPUExecutionProvider")
    assert refused.value.argument == "height and width"
    found = re.fullmatch(
        r"2048×1536 needs at least 2\.4 GB for the VAE decoder's full-resolution activations alone, "
        r"more than 1\.0 GB, the host's available memory; at most about (\d+)×(\d+) fits that bound",
        refused.value.reason,
    )
    assert found, refused.value.reason
    width, height = int(found[1]), int(found[2])
    assert width % 8 == 0 and height % 8 == 0 and abs(width / height - 4 / 3) < 0.02
    memory.check_image_fits(folder, width, height, "CPUExecutionProvider")  # the size it names passes
    with pytest.raises(ArgumentError):
        memory.check_image_fits(folder, width + 64, height + 48, "CPUExecutionProvider")


def test_a_batch_needs_its_images_together(tmp_path, host_with):
    folder = decoder(tmp_path, {"block_out_channels": [128, 256, 512, 512]})
    host_with(10**9)
    with pytest.raises(ArgumentError, match=r"1024×768 × 2 images needs at least 1\.2 GB"):
        memory.check_image_fits(folder, 1024, 768, "CPUExecutionProvider", batch_size=2, argument="size")


def test_nothing_is_refused_where_the_memory_cannot_be_known(tmp_path):
    folder = decoder(tmp_path, None)
    assert memory.available_memory("NoSuchExecutionProvider") is None
    memory.check_image_fits(folder, 10**6, 10**6, "NoSuchExecutionProvider")


def test_the_hosts_memory_is_what_the_cpu_provider_is_checked_against():
    free, where = memory.available_memory("CPUExecutionProvider")
    assert free > 0 and where == "the host's available memory"
