"""Wan 2.1/2.2's causal 3-D VAE exported once as chunk graphs (the first chunk's, every later chunk's), run chunk by
chunk by ``WanVideoCodec`` with the cache handed from call to call: the same videos and latents as diffusers' own
``AutoencoderKLWan.decode`` and ``encode`` (fp32, CPU) for every frame count and size from that one export, graphs
without ScatterND, and refusals that name the argument."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnxruntime
import pytest
import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

from optimum_iobinding.errors import ArgumentError, ArgumentTypeError
from optimum_iobinding.export.components import to_precision, torchscript_export
from optimum_iobinding.export.wan_vae import export_wan_vae, exportable_forwards, scatter_nodes
from optimum_iobinding.layout import WAN_VAE_CHUNK_PART, WAN_VAE_WEIGHTS_FILE, wan_vae_cache_names
from optimum_iobinding.pipelines.wan_codec import WanVideoCodec

TOLERANCE = 1e-4
GRAPHS = [
    (component, file) for component in ("vae_decoder", "vae_encoder") for file in ("model.onnx", WAN_VAE_CHUNK_PART)
]


def tiny_wan21_vae() -> AutoencoderKLWan:
    """diffusers' own test configuration of Wan 2.1's VAE, seeded."""
    torch.manual_seed(0)
    return AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).eval()


def tiny_wan22_vae() -> AutoencoderKLWan:
    """Wan 2.2 TI2V's VAE made small: residual blocks, 2×2 patches (12 channels in and out), 16× spatially."""
    torch.manual_seed(0)
    return AutoencoderKLWan(
        base_dim=4,
        decoder_base_dim=6,
        z_dim=8,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        is_residual=True,
        patch_size=2,
        in_channels=12,
        out_channels=12,
        scale_factor_spatial=16,
    ).eval()


def exported(build):
    def write(folder: Path) -> None:
        export_wan_vae(build(), folder)

    return write


@pytest.fixture(scope="module")
def wan21_vae():
    return tiny_wan21_vae()


@pytest.fixture(scope="module")
def wan21_folder(shared_export):
    return shared_export("tiny-wan21-vae", exported(tiny_wan21_vae))


@pytest.fixture(scope="module")
def wan21(wan21_folder):
    return WanVideoCodec.from_pretrained(wan21_folder, provider="CPUExecutionProvider")


def random(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# ---------------------------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize(
    "shape",
    [(1, 16, 1, 2, 2), (2, 16, 3, 3, 4)],
    ids=["1-latent-frame-16x16", "3-latent-frames-24x32-batch-2"],
)
def test_decode_gives_diffusers_video_for_any_frame_count_and_size(wan21, wan21_vae, shape):
    latents = random(*shape) * 2
    video = wan21.decode(latents)
    with torch.no_grad():
        expected = wan21_vae.decode(latents).sample
    assert video.shape == (shape[0], 3, 1 + 4 * (shape[2] - 1), shape[3] * 8, shape[4] * 8)
    assert max_difference(video, expected) <= TOLERANCE


@pytest.mark.parametrize(
    "shape", [(1, 3, 1, 16, 16), (2, 3, 9, 24, 32)], ids=["1-frame-16x16", "9-frames-24x32-batch-2"]
)
def test_encode_gives_diffusers_latent_mode_for_any_frame_count_and_size(wan21, wan21_vae, shape):
    video = random(*shape, seed=1)
    latents = wan21.encode(video)
    with torch.no_grad():
        expected = wan21_vae.encode(video).latent_dist.mode()
    assert latents.shape == (shape[0], 16, 1 + (shape[2] - 1) // 4, shape[3] // 8, shape[4] // 8)
    assert max_difference(latents, expected) <= TOLERANCE


def test_wan22_patched_residual_vae_decodes_and_encodes_as_diffusers(shared_export):
    vae = tiny_wan22_vae()
    codec = WanVideoCodec.from_pretrained(
        shared_export("tiny-wan22-vae", exported(tiny_wan22_vae)), provider="CPUExecutionProvider"
    )
    latents, video = random(1, 8, 2, 2, 3) * 2, random(1, 3, 5, 32, 48, seed=1)
    with torch.no_grad():
        expected_video = vae.decode(latents).sample
        expected_latents = vae.encode(video).latent_dist.mode()
    assert codec.spatial_scale_factor == 16
    assert max_difference(codec.decode(latents), expected_video) <= TOLERANCE
    assert max_difference(codec.encode(video), expected_latents) <= TOLERANCE


TILES = [  # (tile height, tile width, stride height, stride width) in pixels
    (16, 16, 8, 8),
    (16, 24, 16, 16),
]


@pytest.mark.parametrize("tiles", TILES, ids=["overlapping", "edges-only-in-width"])
def test_tiled_decode_gives_diffusers_tiled_video(wan21, wan21_vae, tiles):
    latents = random(1, 16, 2, 3, 5) * 2
    sizes = dict(zip(("tile_sample_min_height", "tile_sample_min_width", "tile_sample_stride_height",
                      "tile_sample_stride_width"), tiles))  # fmt: skip
    untiled = wan21.decode(latents)
    wan21.enable_tiling(**sizes)
    try:
        video = wan21.decode(latents)
    finally:
        wan21.disable_tiling()
    wan21_vae.enable_tiling(**sizes)
    try:
        with torch.no_grad():
            expected = wan21_vae.decode(latents).sample
    finally:
        wan21_vae.disable_tiling()
    assert video.shape == untiled.shape == expected.shape
    assert max_difference(video, expected) <= TOLERANCE
    assert max_difference(video, untiled) > 100 * TOLERANCE  # the tiles did blend: random weights see the seams


def test_a_patched_vae_decodes_tile_by_tile_as_diffusers(shared_export):
    vae = tiny_wan22_vae()
    codec = WanVideoCodec.from_pretrained(
        shared_export("tiny-wan22-vae", exported(tiny_wan22_vae)), provider="CPUExecutionProvider"
    )
    sizes = dict(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=16,
                 tile_sample_stride_width=16)  # fmt: skip
    latents = random(1, 8, 2, 3, 4) * 2
    codec.enable_tiling(**sizes)
    vae.enable_tiling(**sizes)
    with torch.no_grad():
        expected = vae.decode(latents).sample
    assert max_difference(codec.decode(latents), expected) <= TOLERANCE


@pytest.mark.parametrize(
    "sizes, message",
    [
        (dict(tile_sample_min_height=12), "tile_sample_min_height: expected a positive multiple of 8"),
        (dict(tile_sample_stride_width=0), "tile_sample_stride_width: expected a positive multiple of 8"),
        (dict(tile_sample_min_width=16, tile_sample_stride_width=24), "tile_sample_stride_width: expected at most"),
    ],
    ids=["not-a-multiple", "zero", "stride-beyond-the-tile"],
)
def test_bad_tile_sizes_are_refused_by_name(wan21, sizes, message):
    with pytest.raises(ArgumentError, match=message):
        wan21.enable_tiling(**sizes)
    assert wan21.tiling is None


def test_float16_export_decodes_within_half_precision_of_diffusers(wan21_vae, tmp_path):
    export_wan_vae(wan21_vae, tmp_path, components=["vae_decoder"], dtype="fp16")
    codec = WanVideoCodec.from_pretrained(tmp_path, provider="CPUExecutionProvider")
    latents = random(2, 16, 3, 3, 4) * 2
    video = codec.decode(latents)
    with torch.no_grad():
        expected = wan21_vae.decode(latents).sample
    assert codec.encoder is None and video.dtype == torch.float16
    # on average: the tiny VAE's RMS norms over 3 channels turn a pixel whose channels are all near zero in a direction
    # float16's rounding decides (up to 0.15 apart), which a VAE of 96 channels and more does not meet
    assert torch.isfinite(video).all() and (video.float() - expected).abs().mean().item() <= 2e-3


class _Norms(torch.nn.Module):
    """diffusers' RMS norms over the channels of a video (axis 1) and over the last axis, one after the other."""

    def __init__(self) -> None:
        super().__init__()
        self.video = WanRMS_norm(384, images=False)
        self.last = WanRMS_norm(384, channel_first=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.video(x).transpose(1, -1)).transpose(1, -1)


def test_float16_rms_norm_is_one_node_that_stays_within_range_where_the_sum_of_squares_overflows(tmp_path):
    norms = _Norms().eval()
    norms.video.gamma.data = random(384, 1, 1, 1, seed=2) + 1
    norms.last.gamma.data = random(384, seed=4) + 1
    activations = random(1, 384, 2, 4, 4, seed=3) * 300  # ‖x‖² near 1.2e7, past float16's 65504
    assert (activations.half().float() ** 2).sum(dim=1).max() > 65504
    spec = {
        "module": norms,
        "args": (activations,),
        "input_names": ["x"],
        "output_names": ["y"],
        "dynamic_axes": {"x": {2: "frames", 3: "height", 4: "width"}},
    }
    path = tmp_path / "norms.onnx"
    with exportable_forwards(norms, float16=True):
        torchscript_export(spec, path, 17)
    model = to_precision(path, None, "fp16")
    ops = [node.op_type for node in model.graph.node]
    assert ops.count("SimplifiedLayerNormalization") == 2 and not {"ReduceL2", "Div", "Pow"} & set(ops), ops
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for frames in (2, 5):  # one export for any number of frames
        x = torch.cat([activations] * 3, dim=2)[:, :, :frames]
        with torch.no_grad():
            expected = norms(x)
        (y,) = session.run(None, {"x": x.half().numpy()})
        assert max_difference(torch.from_numpy(y).float(), expected) <= 1e-2


# ------------------------------------------------------------------------------------------------------ graphs
def test_every_chunk_graph_is_free_of_scatter_nd_control_flow_and_pads(wan21_folder):
    for component, file in GRAPHS:
        model = onnx.load(str(wan21_folder / component / file), load_external_data=False)
        assert scatter_nodes(model) == [], (component, file)
        ops = {node.op_type for node in model.graph.node}
        # control flow keeps a graph from being captured; a Pad copies a convolution's whole input
        assert not ops & {"If", "Loop", "Scan", "Pad"}, (component, file, ops & {"If", "Loop", "Scan", "Pad"})


def host_computed_floats(model):
    """The nodes of ``model`` that compute a floating-point value from tensor shapes alone (a ``Shape`` and constants):
    ORT runs shape arithmetic on the host, and a float it makes there is copied to the device on every run, a
    synchronous copy that fails a CUDA graph's capture."""
    constants = {initializer.name for initializer in model.graph.initializer}
    constants |= {output for node in model.graph.node if node.op_type == "Constant" for output in node.output}
    from_shapes, floats = set(), []
    for node in model.graph.node:  # in topological order, as the exporter writes them
        inputs = [name for name in node.input if name and name not in constants]
        if node.op_type == "Shape" or (inputs and all(name in from_shapes for name in inputs)):
            from_shapes.update(node.output)
            float_cast = node.op_type == "Cast" and any(
                attribute.name == "to" and attribute.i in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
                for attribute in node.attribute
            )
            if float_cast or node.op_type in ("Sqrt", "Reciprocal"):
                floats.append(node.name)
    return floats


def test_no_chunk_graph_computes_a_float_from_shapes_on_the_host(wan21_folder):
    for component, file in GRAPHS:
        model = onnx.load(str(wan21_folder / component / file), load_external_data=False)
        assert host_computed_floats(model) == [], (component, file)


def test_later_chunks_take_and_give_a_cache_of_one_fixed_shape(wan21_folder):
    for component in ("vae_decoder", "vae_encoder"):
        first = onnx.load(str(wan21_folder / component / "model.onnx"), load_external_data=False)
        chunk = onnx.load(str(wan21_folder / component / WAN_VAE_CHUNK_PART), load_external_data=False)
        count = len(chunk.graph.input) - 1
        past, present = wan_vae_cache_names(count)
        assert count > 0
        assert [value.name for value in first.graph.input] == [first.graph.input[0].name]
        assert [value.name for value in chunk.graph.input][1:] == list(past)
        assert [value.name for value in first.graph.output][1:] == list(present)
        assert [value.name for value in chunk.graph.output][1:] == list(present)
        dims = lambda value: [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]  # noqa: E731
        for graph_output in (first.graph.output, chunk.graph.output):  # what one call gives, the next one takes
            assert [dims(v) for v in graph_output[1:]] == [dims(v) for v in chunk.graph.input[1:]], component


def test_both_graphs_of_a_component_read_one_copy_of_the_weights(wan21_folder):
    for component in ("vae_decoder", "vae_encoder"):
        places = {}
        for file in ("model.onnx", WAN_VAE_CHUNK_PART):
            model = onnx.load(str(wan21_folder / component / file), load_external_data=False)
            for tensor in model.graph.initializer:
                entries = {entry.key: entry.value for entry in tensor.external_data}
                if entries:
                    assert entries["location"] == WAN_VAE_WEIGHTS_FILE
                    # one name, one place: the runtime hands the chunk graph the first graph's weights by name
                    assert places.setdefault(tensor.name, (entries["offset"], entries["length"])) == (
                        entries["offset"],
                        entries["length"],
                    )
        assert places, component


def test_each_chunk_reads_the_cache_the_call_before_wrote_without_a_copy(wan21):
    runner = wan21.decoder
    with runner.first.watch_runs() as first_runs, runner.chunk.watch_runs() as chunk_runs:
        wan21.decode(random(1, 16, 3, 2, 2))
    runs = [*first_runs, *chunk_runs]
    assert len(first_runs) == 1 and len(chunk_runs) == 2
    for before, after in zip(runs, runs[1:]):
        assert [after.inputs[name] for name in runner.past_names] == before.outputs[1:]


# ---------------------------------------------------------------------------------------------------- refusals
def test_latents_of_the_wrong_rank_or_channels_are_refused_by_name(wan21):
    with pytest.raises(ArgumentError, match=r"^latents: expected a 5-D tensor .*got shape \[1, 16, 2, 2\]"):
        wan21.decode(torch.zeros(1, 16, 2, 2))
    with pytest.raises(ArgumentError, match=r"^latents: expected 16 channels \(dim 1\).*got 4"):
        wan21.decode(torch.zeros(1, 4, 1, 2, 2))
    with pytest.raises(ArgumentTypeError, match=r"^latents: expected a torch.Tensor"):
        wan21.decode([[0.0]])


def test_videos_of_other_frame_counts_sizes_or_channels_are_refused_by_name(wan21):
    with pytest.raises(ArgumentError, match=r"^video: expected 1 \+ 4·k frames \(dim 2\).*got 6; hint: 5 frames"):
        wan21.encode(torch.zeros(1, 3, 6, 16, 16))
    with pytest.raises(ArgumentError, match=r"^video: expected a height and width .* multiples of 8, got 12×16"):
        wan21.encode(torch.zeros(1, 3, 1, 12, 16))
    with pytest.raises(ArgumentError, match=r"^video: expected 3 channels \(dim 1\).*got 4"):
        wan21.encode(torch.zeros(1, 4, 1, 16, 16))


def test_export_refuses_a_vae_other_than_wans(tmp_path):
    with pytest.raises(ArgumentTypeError, match=r"^vae: expected a diffusers AutoencoderKLWan, got Linear"):
        export_wan_vae(torch.nn.Linear(2, 2), tmp_path)


def test_no_export_module_imports_a_private_name_of_another():
    # a module's private names are its own: what another module needs is public, with a docstring
    import ast

    import optimum_iobinding.export as export

    imported = [
        f"{path.name}: {alias.name}"
        for path in sorted(Path(export.__file__).parent.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level > 0
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert imported == []
