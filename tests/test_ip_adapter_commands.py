"""IP-Adapter from the command line: ``export --ip-adapter --image-encoder``, then ``generate`` and ``stream`` with
``--ip-adapter``, ``--ip-adapter-weight``, ``--ip-adapter-image`` and ``--ip-adapter-scale``, against the Python
pipelines; the refusals name the options."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest

from optimum_iobinding import OnnxStableDiffusionPipeline
from optimum_iobinding.cli import main

PROMPT = "a photo of a cat"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny random export for IP-Adapter with a tiny image encoder, and a random adapter file (the test module
    of the pipelines writes both)."""
    from safetensors.torch import save_file

    from optimum_iobinding.export.tiny import build_tiny_random_pipeline
    from tests.ip_adapter_models import adapter_state_dict, image_encoder

    root = tmp_path_factory.mktemp("ip-cli")
    image_encoder().save_pretrained(root / "encoder")
    state = adapter_state_dict(build_tiny_random_pipeline().unet, seed=1)
    flat = {f"{part}.{key}": value.contiguous() for part, weights in state.items() for key, value in weights.items()}
    (root / "adapter" / "models").mkdir(parents=True)
    save_file(flat, str(root / "adapter" / "models" / "ip.safetensors"))
    pixels = (np.random.default_rng(7).random((40, 48, 3)) * 255).astype(np.uint8)
    PIL.Image.fromarray(pixels).save(root / "prompt.png")
    return root


def test_export_and_generate_with_an_image_prompt_equal_the_python_pipeline(made, tmp_path, capsys):
    folder = tmp_path / "onnx"
    argv = ["export", "--tiny-random", "--ip-adapter", "--image-encoder", str(made / "encoder"), "-o", str(folder)]
    assert main(argv) == 0, capsys.readouterr().err
    out = tmp_path / "out.png"
    argv = ["generate", PROMPT, "--model", str(folder), "--out", str(out), "--steps", "2", "--seed", "3"]
    argv += ["--provider", "CPUExecutionProvider", "--height", "64", "--width", "64"]
    argv += ["--ip-adapter", str(made / "adapter"), "--ip-adapter-weight", "models/ip.safetensors"]
    argv += ["--ip-adapter-image", str(made / "prompt.png"), "--ip-adapter-scale", "0.6"]
    assert main(argv) == 0, capsys.readouterr().err
    with PIL.Image.open(out) as image:
        got = np.asarray(image.convert("RGB"))
    pipe = OnnxStableDiffusionPipeline.from_pretrained(folder, provider="CPUExecutionProvider")
    pipe.set_progress_bar_config(disable=True)
    pipe.load_ip_adapter(str(made / "adapter"), subfolder="models", weight_name="ip.safetensors")
    pipe.set_ip_adapter_scale(0.6)
    with PIL.Image.open(made / "prompt.png") as image:
        prompt_image = image.convert("RGB")
    call = dict(prompt=PROMPT, num_inference_steps=2, height=64, width=64)
    expected = pipe(generator=np.random.RandomState(3), ip_adapter_image=prompt_image, **call).images[0]
    assert np.array_equal(got, np.asarray(expected))
    pipe.unload_ip_adapter()
    assert not np.array_equal(got, np.asarray(pipe(generator=np.random.RandomState(3), **call).images[0]))


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--ip-adapter-image", "PROMPT"],
            "--ip-adapter: expected with --ip-adapter-image (the IP-Adapter's three options go together: "
            "--ip-adapter, --ip-adapter-weight, --ip-adapter-image), got none",
        ),
        (
            ["--ip-adapter", "ADAPTER", "--ip-adapter-image", "PROMPT"],
            "--ip-adapter-weight: expected with --ip-adapter and --ip-adapter-image (the IP-Adapter's three options",
        ),
        (
            ["--ip-adapter", "ADAPTER", "--ip-adapter-weight", "models/ip.safetensors", "--ip-adapter-image", "x.png"],
            "--ip-adapter-image: expected an image file",
        ),
        (
            ["--ip-adapter", "ADAPTER", "--ip-adapter-weight", "models/ip.safetensors", "--ip-adapter-image", "PROMPT"],
            "--ip-adapter: expected a UNet exported for IP-Adapter",
        ),
        (["--ip-adapter-scale", "0.5"], "--ip-adapter-scale: expected it with --ip-adapter, got it alone"),
    ],
    ids=["no-adapter", "no-weight", "no-image-file", "plain-model", "scale-alone"],
)
def test_generate_refuses_ip_adapter_mistakes_naming_the_option(made, tmp_path, capsys, extra, message):
    extra = [
        str(made / "adapter") if a == "ADAPTER" else str(made / "prompt.png") if a == "PROMPT" else a for a in extra
    ]
    argv = ["generate", PROMPT, "--out", str(tmp_path / "o.png"), "--steps", "1", "--cache-dir", str(tmp_path / "c")]
    assert main([*argv, "--provider", "CPUExecutionProvider", *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o.png").exists()
