"""The UNet's cold-start parts: written by the export beside its model.onnx, run in turn by the model and the
pipelines in its place, with what the whole UNet computes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch

from optimum_iobinding import IOBindingORTModel, OnnxStableDiffusionPipeline
from optimum_iobinding.errors import ArgumentError, ArgumentTypeError, ModelFileError
from optimum_iobinding.export import export_pipeline
from optimum_iobinding.export.cold_parts import cold_start_cuts, graph_order, write_cold_start_parts
from optimum_iobinding.export.tiny import TINY_RANDOM_KINDS
from optimum_iobinding.layout import COLD_START_PART, cold_start_part_files
from optimum_iobinding.runtime.shapes import infer_output_shapes


def with_parts(folder, target, parts):
    """A copy of the exported ``folder`` whose UNet has ``parts`` cold-start parts."""
    shutil.copytree(folder, target)
    write_cold_start_parts(target / "unet", parts)
    return target


@pytest.fixture(scope="module")
def parted(tiny_folder, tmp_path_factory):
    return with_parts(tiny_folder, tmp_path_factory.mktemp("cold") / "sd", 2)


@pytest.fixture(scope="module")
def parted_fused(tiny_fused_folder, tmp_path_factory):
    # four parts: the middle ones take no input of the UNet's full size of their own (their attention tokens are
    # height × width expressions), so the export gives them the sample too
    return with_parts(tiny_fused_folder, tmp_path_factory.mktemp("cold-fused") / "sd", 4)


def pipe_of(folder, **options):
    pipe = OnnxStableDiffusionPipeline.from_pretrained(folder, **options)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def images(pipe, steps: int):
    """The pipeline's images of one seeded 64² call of ``steps`` steps."""
    return pipe(
        "a cat",
        height=64,
        width=64,
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(1),
        output_type="np",
    ).images


def unet_inputs(timestep_rows: int = 2):
    generator = torch.Generator().manual_seed(0)
    return {
        "sample": torch.randn(2, 4, 8, 8, generator=generator),
        "timestep": torch.full((timestep_rows,), 7.0),
        "encoder_hidden_states": torch.randn(2, 77, 32, generator=generator),
    }


@pytest.mark.parametrize("fixture", ["parted", "parted_fused"])
@pytest.mark.parametrize("timestep_rows", [2, 1])
def test_a_unet_with_parts_runs_them_in_turn_and_gives_the_whole_models_output(
    fixture, timestep_rows, tiny_folder, tiny_fused_folder, request
):
    folder = request.getfixturevalue(fixture)
    whole_folder = tiny_folder if fixture == "parted" else tiny_fused_folder
    parts = cold_start_part_files(folder / "unet")
    assert [path.name for path in parts] == [COLD_START_PART.format(number=k) for k in range(len(parts))]
    assert len(parts) == (2 if fixture == "parted" else 4)
    model = IOBindingORTModel.from_pretrained(folder / "unet")
    whole = IOBindingORTModel.from_pretrained(whole_folder / "unet")
    assert len(model.cold_start_parts) == len(parts) and whole.cold_start_parts == []
    assert model.input_names == whole.input_names and model.output_names == whole.output_names
    inputs = unet_inputs(timestep_rows)  # one timestep row for the batch: expanded for the first part
    (got,) = model(**inputs)
    (expected,) = whole(**inputs)
    assert got.shape == expected.shape and torch.equal(got, expected)
    (from_numpy,) = model(**{**inputs, "timestep": inputs["timestep"].numpy()})  # as diffusers' numpy pipelines call
    assert torch.equal(from_numpy, expected)
    # the whole model's session is never made: one session per part
    assert model.sessions_created == len(parts)
    # each part's input shapes, known before any run from the declared dims of the parts before it
    shapes = model.cold_start_part_shapes({name: tuple(value.shape) for name, value in inputs.items()})
    assert shapes[0]["timestep"] == (2,) and shapes[0]["sample"] == (2, 4, 8, 8)
    for part, part_shapes in zip(model.cold_start_parts[1:], shapes[1:]):
        assert set(part_shapes) == set(part.input_names)
        assert all(len(shape) >= 1 and all(d > 0 for d in shape) for shape in part_shapes.values())
    # and each part sizes its outputs from its inputs alone, as it runs: the shapes the parts' runs give
    values = dict(inputs, timestep=inputs["timestep"].expand(2).contiguous())
    for part, part_shapes in zip(model.cold_start_parts, shapes):
        assert part_shapes == {name: tuple(values[name].shape) for name in part.input_names}
        outputs = part(**{name: values[name] for name in part.input_names})
        predicted = part.shape_inferencer(part_shapes)
        for name, output in zip(part.output_names, outputs):
            assert predicted[name] == tuple(output.shape), name
        values.update(zip(part.output_names, outputs))


@pytest.mark.parametrize("io_binding, fused", [(True, False), (False, False), (True, True)])
def test_the_pipeline_with_the_unets_parts_makes_the_same_images(
    parted, parted_fused, tiny_folder, tiny_fused_folder, io_binding, fused
):
    def folder_images(folder):
        return images(pipe_of(folder, io_binding=io_binding), steps=3)

    if fused:
        np.testing.assert_array_equal(folder_images(parted_fused), folder_images(tiny_fused_folder))
    else:
        np.testing.assert_array_equal(folder_images(parted), folder_images(tiny_folder))


def test_a_model_made_from_a_given_session_runs_that_session(parted):
    import onnxruntime as ort

    session = ort.InferenceSession(str(parted / "unet" / "model.onnx"), providers=["CPUExecutionProvider"])
    model = IOBindingORTModel(session)
    assert model.cold_start_parts == [] and model.session is session
    # saved onto its own file, it leaves the folder as it is: the parts there were made from that file
    before = sorted(path.name for path in (parted / "unet").iterdir())
    model.save_pretrained(parted / "unet")
    assert sorted(path.name for path in (parted / "unet").iterdir()) == before


def test_a_saved_pipeline_keeps_the_unets_parts(parted, tmp_path):
    pipe = OnnxStableDiffusionPipeline.from_pretrained(parted)
    pipe.save_pretrained(tmp_path / "saved")
    assert [path.name for path in cold_start_part_files(tmp_path / "saved" / "unet")] == [
        path.name for path in cold_start_part_files(parted / "unet")
    ]
    saved = IOBindingORTModel.from_pretrained(tmp_path / "saved" / "unet")
    inputs = unet_inputs()
    assert torch.equal(saved(**inputs)[0], pipe.unet(**inputs)[0])


def test_a_lora_reaches_the_unets_parts(parted, tiny_folder, make_lora, tmp_path):
    lora = make_lora(TINY_RANDOM_KINDS["sd"](), tmp_path / "lora", 1, ["to_q", "to_v", "conv1", "ff.net.2"])

    ours, reference = pipe_of(parted), pipe_of(tiny_folder)
    before = images(ours, steps=2)
    for pipe in (ours, reference):
        pipe.load_lora_weights(lora, adapter_name="a")
    after = images(ours, steps=2)
    assert np.abs(after - before).max() > 1e-3  # the LoRA changed the image
    np.testing.assert_allclose(after, images(reference, steps=2), atol=1e-5)
    # the parts read the UNet's owned weights now: one copy, changed in place
    owned = ours.unet.owned_weights
    assert owned
    for part in ours.unet.cold_start_parts:
        assert all(part.owned_weights[name] is tensor for name, tensor in owned.items())


def test_deepcaches_folder_with_parts_runs_the_parts_uncached_and_its_own_graphs_cached(tmp_path):
    from optimum_iobinding import DeepCacheConfig

    folder = export_pipeline(
        None, tmp_path / "sd", tiny_random=True, progress=False, step_cache=True, cold_start_parts=2
    )
    plain = tmp_path / "plain"
    shutil.copytree(folder, plain)
    for path in cold_start_part_files(plain / "unet"):
        path.unlink()
    runs = {}
    for name, source in (("parts", folder), ("plain", plain)):
        pipe = pipe_of(source)
        # DeepCache's folder owns the UNet's weights from the start: the parts read them
        assert len(pipe.unet.cold_start_parts) == (2 if name == "parts" else 0)
        uncached = images(pipe, steps=4)
        pipe.enable_cache(DeepCacheConfig(cache_interval=2, cache_branch_id=0))
        cached = images(pipe, steps=4)
        runs[name] = (uncached, cached)
    np.testing.assert_array_equal(runs["parts"][0], runs["plain"][0])
    np.testing.assert_array_equal(runs["parts"][1], runs["plain"][1])


def test_the_cuts_share_out_the_convolutions_and_the_graph_order_puts_makers_first(tiny_folder, tmp_path):
    model = onnx.load(str(tiny_folder / "unet" / "model.onnx"))
    convolutions = sum(node.op_type == "Conv" for node in model.graph.node)
    with pytest.raises(ArgumentError, match=f"cold_start_parts: expected at most {convolutions} .*, got 999"):
        cold_start_cuts(model, 999)
    for wrong in (1, 0, True, 2.5):
        with pytest.raises(ArgumentError, match="cold_start_parts: expected an integer of 2 or more"):
            cold_start_cuts(model, wrong)
    cuts = cold_start_cuts(model, 3)
    assert len(cuts) == 3 and cuts[-1] is None and all(cuts[:-1])
    # stored in reverse, every node before the makers of its inputs: the order puts the makers first again
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    order = graph_order(model.graph)
    made_before = set(value.name for value in model.graph.input) | {t.name for t in model.graph.initializer} | {""}
    for position in order:
        node = model.graph.node[position]
        assert all(name in made_before for name in node.input), node.name
        made_before.update(node.output)
    assert sorted(order) == list(range(len(nodes)))


def test_export_writes_the_parts_and_refuses_a_wrong_count(tmp_path):
    folder = export_pipeline(None, tmp_path / "sd", tiny_random=True, progress=False, cold_start_parts=2)
    assert len(cold_start_part_files(folder / "unet")) == 2
    assert cold_start_part_files(folder / "text_encoder") == []
    for wrong in (1, -2, True, "2"):
        with pytest.raises(ArgumentError, match="cold_start_parts: expected 0 or an integer of 2 or more"):
            export_pipeline(None, tmp_path / "wrong", tiny_random=True, progress=False, cold_start_parts=wrong)
    with pytest.raises(ArgumentError, match=r"cold_start_parts: expected 0 for a StableDiffusion3Pipeline"):
        export_pipeline(None, tmp_path / "sd3", tiny_random="sd3", progress=False, cold_start_parts=2)
    assert not (tmp_path / "wrong").exists() and not (tmp_path / "sd3").exists()


def test_the_export_command_names_its_option_when_it_refuses_a_count(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "optimum_iobinding.cli", "export", "--tiny-random", "--cold-start-parts", "1", "-o"]
        + [str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith("--cold-start-parts: expected 0 or an integer of 2 or more, got 1")
    )
    assert not (tmp_path / "out").exists()


def linked_unet(tiny_folder, tmp_path):
    """A copy of the tiny UNet with every weight in one file that has a second hard link (as ``cp -al`` makes)."""
    folder = tmp_path / "unet"
    shutil.copytree(tiny_folder / "unet", folder)
    model = onnx.load(str(folder / "model.onnx"))
    (folder / "model.onnx").unlink()
    onnx.save_model(model, str(folder / "model.onnx"), save_as_external_data=True, location="weights.pb")
    os.link(folder / "weights.pb", tmp_path / "second-link.pb")
    return folder


def test_parts_are_refused_where_shape_inference_cannot_read_the_weights(tiny_folder, tmp_path):
    folder = linked_unet(tiny_folder, tmp_path)
    with pytest.raises(ModelFileError, match="model.onnx: ORT's symbolic shape inference.* failed: .*hard link"):
        write_cold_start_parts(folder, 2)
    assert not list(folder.glob("cold_part_*"))  # no part written without its dims
    # the runtime's shape inference names the file and the weight it could not read
    with pytest.raises(
        ModelFileError, match="model.onnx: cannot read the weight .* from its weights file: .*hard link"
    ):
        infer_output_shapes(
            str(folder / "model.onnx"), {"sample": (2, 4, 8, 8), "timestep": (2,), "encoder_hidden_states": (2, 77, 32)}
        )


def test_a_part_that_takes_what_no_part_before_it_gives_is_named(parted, tmp_path):
    # parts that do not belong together (a part written again from another export, or without its dims): the first
    # part no longer gives a value the second takes
    folder = tmp_path / "unet"
    shutil.copytree(parted / "unet", folder)
    first = folder / COLD_START_PART.format(number=0)
    maker = onnx.load(str(first))
    taken = {value.name for value in onnx.load(str(folder / COLD_START_PART.format(number=1))).graph.input}
    dropped = next(value for value in maker.graph.output if value.name in taken)
    maker.graph.output.remove(dropped)
    onnx.save_model(maker, str(first))
    model = IOBindingORTModel.from_pretrained(folder)
    shapes = {name: tuple(tensor.shape) for name, tensor in unet_inputs().items()}
    with pytest.raises(ModelFileError, match=f"cold_part_1.onnx: takes \\[{dropped.name!r}.*export the UNet's cold"):
        model.cold_start_part_shapes(shapes)


def test_parts_of_another_cut_in_the_folder_are_refused_or_replaced(parted, parted_fused, tiny_folder, tmp_path):
    four = tmp_path / "four"
    shutil.copytree(parted_fused / "unet", four)
    # writing fewer parts where more are: the runtime would run the old ones after the new
    with pytest.raises(FileExistsError, match="expected no cold-start parts past the 2 asked for, got cold_part_2"):
        write_cold_start_parts(four, 2)
    assert len(cold_start_part_files(four)) == 4
    two, whole = (
        IOBindingORTModel.from_pretrained(parted / "unet"),
        IOBindingORTModel.from_pretrained(tiny_folder / "unet"),
    )
    inputs = unet_inputs()
    expected = whole(**inputs)[0]
    for model, kept in ((two, 2), (whole, 0)):
        target = tmp_path / f"saved-{kept}"
        shutil.copytree(parted_fused / "unet", target)
        with pytest.raises(FileExistsError, match="cold_part_3.onnx"):
            model.save_pretrained(target)
        model.save_pretrained(target, overwrite=True)
        assert len(cold_start_part_files(target)) == kept
        saved = IOBindingORTModel.from_pretrained(target)
        assert len(saved.cold_start_parts) == kept
        assert torch.equal(saved(**inputs)[0], expected)


def test_a_model_of_fresh_outputs_runs_its_parts_on_reused_buffers_and_clones_the_last(parted, tiny_folder):
    model = IOBindingORTModel.from_pretrained(parted / "unet", reuse_outputs=False)
    # the parts hand their outputs to the next parts as their buffers are
    assert all(part.reuse_outputs for part in model.cold_start_parts)
    with pytest.raises(ArgumentTypeError, match=r"part: expected settings among \[.*\], got \['provider'\]"):
        model.part(parted / "unet" / COLD_START_PART.format(number=0), provider="cpu")
    inputs = unet_inputs()
    (first,), (second,) = model(**inputs), model(**inputs)
    assert first.data_ptr() != second.data_ptr()  # fresh tensors, as the model was asked for
    expected = IOBindingORTModel.from_pretrained(tiny_folder / "unet")(**inputs)[0]
    assert torch.equal(first, expected) and torch.equal(second, expected)
