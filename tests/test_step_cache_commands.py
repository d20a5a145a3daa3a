"""A step cache by name: the text ``generate --cache`` and a server's ``cache`` setting take (``fbc:THRESHOLD``,
``deepcache:INTERVAL[:BRANCH]``), checked before any work, and what it turns on."""

from __future__ import annotations

import shutil
from dataclasses import asdict

import pytest

from optimum_iobinding.cache_spec import parse_cache_spec
from optimum_iobinding.cli import main
from optimum_iobinding.errors import ArgumentError
from optimum_iobinding.export.tiny import build_tiny_random_flux_pipeline
from tests.commands import error_line


@pytest.fixture(scope="module")
def schnell_parts(shared_export):
    """The tiny random FLUX.1 schnell pipeline exported with First-Block Cache's parts."""

    def write(folder) -> None:
        from optimum_iobinding.export import export_pipeline

        export_pipeline(
            None,
            folder,
            torch_pipeline=build_tiny_random_flux_pipeline(0, guidance_embeds=False),
            progress=False,
            step_cache=True,
        )

    return shared_export("schnell-step-cache", write)


@pytest.mark.parametrize(
    "spec, parsed",
    [
        ("fbc:0.08", ("fbc", (0.08,))),
        ("fbc:1e-1", ("fbc", (0.1,))),
        ("deepcache:3", ("deepcache", (3,))),
        ("deepcache:3:1", ("deepcache", (3, 1))),
    ],
)
def test_a_cache_spec_names_the_cache_and_its_values(spec, parsed):
    assert parse_cache_spec(spec) == parsed


@pytest.mark.parametrize(
    "spec", ["fbc", "fbc:", "fbc:high", "fbc:0.1:2", "deepcache:3.5", "deepcache:3:1:0", "tea:0.1", "", 0.08, None]
)
def test_a_spec_of_another_form_is_refused_naming_the_forms(spec):
    with pytest.raises(
        ArgumentError,
        match=r"cache: expected fbc:THRESHOLD \(First-Block Cache: SD3, FLUX.1, Wan\) or "
        r"deepcache:INTERVAL\[:BRANCH\] \(DeepCache: SD, SDXL\), got",
    ):
        parse_cache_spec(spec)


def test_generate_refuses_a_bad_cache_before_any_work(capsys, tmp_path):
    assert main(["generate", "--cache", "fbc:often", "--out", str(tmp_path / "image.png")]) == 2
    error = capsys.readouterr().err
    assert "--cache: expected fbc:THRESHOLD" in error and "got 'fbc:often'" in error
    assert not (tmp_path / "image.png").exists()


def test_generate_with_first_block_cache_says_how_many_steps_ran_whole(schnell_parts, capsys, tmp_path):
    out = tmp_path / "image.png"
    assert (
        main(
            [
                "generate",
                "a red castle",
                "--model",
                str(schnell_parts),
                "--cache",
                "fbc:10",
                "--steps",
                "3",
                "--height",
                "64",
                "--width",
                "48",
                "--provider",
                "CPUExecutionProvider",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert out.is_file()
    assert "cache fbc:10: 1 of 3 steps ran whole" in capsys.readouterr().out


def test_generate_names_cache_when_the_folder_lacks_the_parts(schnell, capsys, tmp_path):
    _, folder = schnell
    assert (
        main(
            [
                "generate",
                "a red castle",
                "--model",
                str(folder),
                "--cache",
                "fbc:0.1",
                "--steps",
                "2",
                "--height",
                "64",
                "--width",
                "48",
                "--provider",
                "CPUExecutionProvider",
                "--out",
                str(tmp_path / "image.png"),
            ]
        )
        == 2
    )
    assert "--cache: First-Block Cache runs the transformer's parts" in capsys.readouterr().err


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(cache="fbc"), r"cache: expected fbc:THRESHOLD"),
        (dict(cache="fbc:0.1", engine="diffusers-numpy"), r"cache: expected None with engine='diffusers-numpy'"),
    ],
)
def test_a_server_config_refuses_a_bad_cache_by_name(settings, message):
    from optimum_iobinding.serve import ServeConfig

    with pytest.raises(ArgumentError, match=message):
        ServeConfig(model="folder", **settings)


def test_a_servers_cache_is_off_by_default_and_on_for_every_request_when_set(schnell_parts):
    from optimum_iobinding.serve import ImageGenerator, ServeConfig

    assert ServeConfig(model="folder").cache is None
    generator = ImageGenerator(
        asdict(ServeConfig(model=str(schnell_parts), device="cpu", cache="fbc:0.2", warmup_batch_sizes=[]))
    )
    assert generator.pipe.step_cache.config.threshold == 0.2
    assert ServeConfig.from_args({"model": "folder", "cache": "deepcache:3:1"}).cache == "deepcache:3:1"


@pytest.fixture(scope="module")
def sd_deep_cache(shared_export):
    """The tiny random SD pipeline exported with DeepCache's parts (shared with the export's tests)."""
    from optimum_iobinding.export import export_pipeline

    return shared_export(
        "sd-deep-cache",
        lambda target: export_pipeline(None, target, tiny_random="sd", step_cache=True, progress=False),
    )


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_folder_without_deepcaches_parts_is_refused_before_any_work(command, tiny_folder, tmp_path, capsys, no_work):
    if command == "serve":
        pytest.importorskip("ray.serve")
        argv = ["serve", str(tiny_folder), "--device", "cpu"]
    else:
        argv = ["generate", "a cat", "--model", str(tiny_folder), "--out", str(tmp_path / "image.png")]
    assert main([*argv, "--cache", "deepcache:3"]) == 2
    assert error_line(capsys) == (
        "optimum-iobinding: error: --cache: DeepCache runs the UNet's parts deep_cache_full.onnx and "
        f"deep_cache_shallow_<branch>.onnx, but {tiny_folder / 'unet'} lacks them; export the model again with "
        "--step-cache"
    )


def test_a_deepcache_branch_the_unet_lacks_is_refused_before_any_work(sd_deep_cache, tmp_path, capsys, no_work):
    argv = ["generate", "a cat", "--model", str(sd_deep_cache), "--out", str(tmp_path / "image.png")]
    assert main([*argv, "--cache", "deepcache:3:9"]) == 2
    assert error_line(capsys) == (
        "optimum-iobinding: error: --cache: expected a branch among this UNet's [0, 1, 2, 3, 4, 5], got 'deepcache:3:9'"
    )


def test_a_transformer_lacking_a_first_block_cache_part_is_refused_before_any_work(
    schnell_parts, tmp_path, capsys, no_work
):
    folder = tmp_path / "schnell"
    shutil.copytree(schnell_parts, folder)
    (folder / "transformer" / "body.onnx").unlink()
    argv = ["generate", "a cat", "--model", str(folder), "--out", str(tmp_path / "image.png")]
    assert main([*argv, "--cache", "fbc:0.08"]) == 2
    assert error_line(capsys) == (
        "optimum-iobinding: error: --cache: First-Block Cache runs the transformer's parts ['head.onnx', 'body.onnx', "
        f"'out.onnx'], but {folder / 'transformer'} lacks ['body.onnx']; export the model again with --step-cache"
    )
