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
        (
            ["--ip-adapter", "ADAPTER", "--ip-adapter-weight", "models", "--ip-adapter-image", "PROMPT"],
            "--ip-adapter-weight: expected a weights file in the --ip-adapter folder '{adapter}', got 'models': a "
            "folder there",
        ),
        (
            ["--ip-adapter", "ADAPTER", "--ip-adapter-weight", "models/no.safetensors", "--ip-adapter-image", "PROMPT"],
            "got 'models/no.safetensors': no such file there",
        ),
        (
            ["--ip-adapter", "no-such-user/no-such-adapter", "--ip-adapter-weight", "ip.bin", "--ip-adapter-image"],
            "--ip-adapter: 'no-such-user/no-such-adapter' is not a local folder (no such path here), and the Hugging "
            "Face Hub could not provide it",
        ),
    ],
    ids=[
        "no-adapter",
        "no-weight",
        "no-image-file",
        "plain-model",
        "scale-alone",
        "weight-folder",
        "no-weight-file",
        "hub",
    ],
)
def test_generate_refuses_ip_adapter_mistakes_naming_the_option(made, tmp_path, capsys, extra, message):
    extra = [
        str(made / "adapter") if a == "ADAPTER" else str(made / "prompt.png") if a == "PROMPT" else a for a in extra
    ]
    if extra[-1] == "--ip-adapter-image":
        extra.append(str(made / "prompt.png"))
    argv = ["generate", PROMPT, "--out", str(tmp_path / "o.png"), "--steps", "1", "--cache-dir", str(tmp_path / "c")]
    assert main([*argv, "--provider", "CPUExecutionProvider", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # (the tiny model's build may show its progress first)
    assert message.format(adapter=made / "adapter") in err[-1], err
    assert not any("WARNING" in line or "etry" in line for line in err), err  # no retries or warnings before it
    assert not (tmp_path / "o.png").exists()


@pytest.mark.parametrize("command", ["generate", "stream"])
def test_an_image_prompt_for_a_folder_without_an_image_encoder_names_the_model_option(made, tmp_path, capsys, command):
    """The folder's UNet takes image prompts, but the folder has no image encoder to encode the image with."""
    folder = tmp_path / "onnx"
    assert main(["export", "--tiny-random", "--ip-adapter", "-o", str(folder)]) == 0, capsys.readouterr().err
    ip = ["--ip-adapter", str(made / "adapter"), "--ip-adapter-weight", "models/ip.safetensors"]
    ip += ["--ip-adapter-image", str(made / "prompt.png"), "--model", str(folder), "--provider", "CPUExecutionProvider"]
    if command == "generate":
        argv = ["generate", PROMPT, "--out", str(tmp_path / "o.png"), "--steps", "1"]
    else:
        (tmp_path / "frames").mkdir()
        PIL.Image.new("RGB", (64, 64)).save(tmp_path / "frames" / "0.png")
        argv = ["stream", str(tmp_path / "frames"), str(tmp_path / "o"), "--prompt", PROMPT]
    capsys.readouterr()
    assert main([*argv, *ip]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "optimum-iobinding: error: --ip-adapter-image: expected a --model folder with an image_encoder/ (export "
        f"--ip-adapter --image-encoder ID_OR_FOLDER), got {str(folder)!r}, which has none"
    )
    assert not (tmp_path / "o.png").exists() and not (tmp_path / "o").exists()
