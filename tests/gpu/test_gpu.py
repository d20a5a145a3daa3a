"""The GPU fast path (skipped without CUDA; run on the GPU machine): graphs, the shared stream, no host waits, no
reallocation between steps."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
import torch

from optimum_iobinding.bench.probes import host_waits
from optimum_iobinding.pipelines.loop import Guidance, denoise

pytestmark = pytest.mark.gpu

CUDA = "CUDAExecutionProvider"
# exact comparisons: without TF32, fp32 convolutions and matmuls on Hopper round like the CPU's
EXACT = {"use_tf32": "0"}
SIZE = 64


def unet_inputs(unet, batch=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = unet.input_dims["encoder_hidden_states"][2]
    return {
        "sample": torch.randn(batch, 4, 8, 8, generator=generator).to(unet.device),
        "timestep": torch.full((batch,), 500.0, device=unet.device),
        "encoder_hidden_states": torch.randn(batch, 77, hidden, generator=generator).to(unet.device),
    }


def pipeline(folder, **kwargs):
    from diffusers import DDIMScheduler

    from optimum_iobinding import OnnxStableDiffusionPipeline

    kwargs.setdefault("provider_options", EXACT)
    pipe = OnnxStableDiffusionPipeline.from_pretrained(folder, provider=CUDA, **kwargs)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, steps=5, seed=0):
    return pipe(
        "a photo of a cat",
        height=SIZE,
        width=SIZE,
        num_inference_steps=steps,
        generator=np.random.RandomState(seed),
        output_type="np",
    ).images


def test_graph_model_equals_the_plain_model_and_replays(tiny_folder):
    from optimum_iobinding import IOBindingORTModel

    plain = IOBindingORTModel.from_pretrained(
        tiny_folder, subfolder="unet", provider=CUDA, provider_options=EXACT, cuda_graph=False
    )
    graph = IOBindingORTModel.from_pretrained(
        tiny_folder, subfolder="unet", provider=CUDA, provider_options=EXACT, cuda_graph=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback would warn
        for seed in range(3):
            inputs = unet_inputs(plain, seed=seed)
            expected = plain(**inputs)[0].clone()
            got = graph(**inputs)[0]
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    runner = graph.graph_runner({name: tuple(value.shape) for name, value in inputs.items()})
    assert len(graph.graph_signatures) == 1 and runner.runs == 3  # one capture, then replays reading the new inputs


def test_pipeline_graph_equals_no_graph_equals_numpy_loop(tiny_folder):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        graph_pipe = pipeline(tiny_folder, cuda_graph=True)
        with_graph = generate(graph_pipe)
    without_graph = generate(pipeline(tiny_folder, cuda_graph=False))
    numpy_loop = generate(pipeline(tiny_folder, io_binding=False))
    assert np.abs(with_graph - without_graph).max() <= 1e-3
    assert np.abs(without_graph - numpy_loop).max() <= 1e-3
    assert graph_pipe.unet.graph_signatures  # the graph path really ran


@pytest.mark.parametrize(
    "scheduler,guidance,cuda_graph",
    [
        (None, 7.5, False),  # DDIM, as pipeline() sets it
        (None, 7.5, True),
        ("EulerAncestralDiscreteScheduler", 0.0, True),  # SD-Turbo's recipe: trailing spacing, fresh noise every step
        ("EulerDiscreteScheduler", 7.5, True),
        ("DPMSolverMultistepScheduler", 7.5, True),
        ("LCMScheduler", 0.0, True),
        ("UniPCMultistepScheduler", 7.5, True),  # its traced steps (pipelines/linear_steps.py), not its own
    ],
)
def test_the_host_enqueues_the_whole_loop_without_waiting(tiny_folder, scheduler, guidance, cuda_graph):
    import diffusers

    pipe = pipeline(tiny_folder, cuda_graph=cuda_graph)
    if scheduler is not None:
        pipe.scheduler = getattr(diffusers, scheduler).from_config(pipe.scheduler.config, timestep_spacing="trailing")
    with torch.cuda.stream(pipe.stream):
        embeds = pipe.encode_prompt("a photo of a cat", 1, guidance > 1)
        latents = pipe.prepare_latents((1, 4, 8, 8), embeds.dtype, np.random.RandomState(0))

        def loop():
            timesteps = pipe.set_timesteps(4)
            kwargs = pipe.scheduler_step_kwargs(torch.Generator("cuda").manual_seed(0), 0.0)
            return denoise(
                pipe.denoiser,
                latents,
                timesteps,
                tensors={"prompt_embeds": embeds},
                guidance=Guidance.classifier_free(guidance),
                step_kwargs=kwargs,
            )

        loop()  # warm up at this batch (1 without guidance): capture, cuDNN algorithm search
        torch.cuda.synchronize()
        waits = host_waits(loop)
    assert waits == [], "\n".join(f"{waits.count(w)}× {w}" for w in sorted(set(waits)))
    torch.cuda.synchronize()


def test_a_captured_step_copies_only_its_timestep_into_the_graph(tiny_folder, monkeypatch):
    # the guidance batch is concatenated straight into the graph's sample input and the prompt embeddings are
    # copied in once a call: of the graph's three inputs only the timestep is copied each step
    pipe = pipeline(tiny_folder, cuda_graph=True)
    with torch.cuda.stream(pipe.stream):
        embeds = pipe.encode_prompt("a photo of a cat", 1, True)
        latents = pipe.prepare_latents((1, 4, 8, 8), embeds.dtype, np.random.RandomState(0))

        def loop(steps):
            return denoise(
                pipe.denoiser,
                latents,
                pipe.set_timesteps(steps),
                tensors={"prompt_embeds": embeds},
                guidance=Guidance.classifier_free(7.5),
                step_kwargs=pipe.scheduler_step_kwargs(None, 0.0),
            )

        expected = loop(6).clone()  # the first call captures
        copied = []
        copy = torch.Tensor.copy_
        monkeypatch.setattr(
            torch.Tensor, "copy_", lambda self, *a, **k: copied.append(self.data_ptr()) or copy(self, *a, **k)
        )
        with torch.inference_mode():
            latents_out = loop(6)
        monkeypatch.undo()
        torch.cuda.synchronize()
    (signature,) = pipe.unet.graph_signatures
    buffers = pipe.unet.graph_input_buffers(signature)
    # the loop finds the buffers after its first call, whose inputs the graph runner copies in as any input; the
    # loop then copies the embeddings in once more and passes the buffer itself from there on
    assert {name: copied.count(tensor.data_ptr()) for name, tensor in buffers.items()} == {
        "sample": 1,
        "timestep": 6,
        "encoder_hidden_states": 2,
    }
    torch.testing.assert_close(latents_out, expected, rtol=0, atol=0)


def test_a_graph_first_run_under_inference_mode_takes_inputs_outside_it(tiny_folder):
    # its input buffers are normal tensors: an inference tensor would refuse the copies of later calls
    from optimum_iobinding import IOBindingORTModel

    unet = IOBindingORTModel.from_pretrained(
        tiny_folder, subfolder="unet", provider=CUDA, provider_options=EXACT, cuda_graph=True
    )
    inputs = unet_inputs(unet)
    with torch.inference_mode():
        first = unet(**inputs)[0].clone()
    for _ in range(3):
        again = unet(**unet_inputs(unet))[0]
    assert unet.graph_signatures
    torch.testing.assert_close(again, first)


def test_the_profiler_sees_ort_synchronizing_when_it_is_allowed_to(tiny_folder):
    # the control for the test above: a session on ORT's own stream waits after every run, and we see it
    import onnxruntime as ort

    from optimum_iobinding import IOBindingORTModel

    session = ort.InferenceSession(str(tiny_folder / "unet" / "model.onnx"), providers=[CUDA])
    model = IOBindingORTModel(session)
    inputs = unet_inputs(model)
    model(**inputs)
    assert host_waits(lambda: model(**inputs))


@pytest.mark.parametrize("generator", ["torch-cpu", "numpy"])
def test_prompt_ids_and_initial_noise_go_up_while_the_gpu_is_still_busy(tiny_folder, generator):
    # in a server the next batch is prepared while the last one runs: its uploads must not wait for the stream (a copy
    # from pageable memory would). The GPU is kept busy on the pipeline's stream; the host prepares a call's inputs,
    # and the busy work must still be running when the host is done
    pipe = pipeline(tiny_folder)
    generate(pipe)  # sessions made and graphs captured
    size = (1, 4, SIZE // 8, SIZE // 8)
    make = {"torch-cpu": lambda: torch.Generator().manual_seed(0), "numpy": lambda: np.random.RandomState(0)}[generator]
    with torch.cuda.stream(pipe.stream):
        embeds = pipe.encode_prompt("a photo of a cat", 1, True)
        expected = pipe.prepare_latents(size, embeds.dtype, make()).clone()
        torch.cuda.synchronize()
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(200):  # a second or so of GPU work, queued ahead of the uploads
            a = a @ a / 64
        busy = torch.cuda.Event()
        busy.record()
        embeds = pipe.encode_prompt("a photo of a cat", 1, True)
        latents = pipe.prepare_latents(size, embeds.dtype, make())
        still_busy = not busy.query()
        torch.cuda.synchronize()
    assert still_busy, "the host waited for the GPU's earlier work while preparing the call's inputs"
    torch.testing.assert_close(latents, expected, rtol=0, atol=0)


def test_buffers_are_not_reallocated_between_steps(tiny_folder):
    pipe = pipeline(tiny_folder)
    allocated = []
    with pipe.unet.watch_runs() as runs:
        pipe(
            "a photo of a cat",
            height=SIZE,
            width=SIZE,
            num_inference_steps=6,
            generator=np.random.RandomState(0),
            output_type="latent",
            callback_on_step_end=lambda p, i, t, tensors: allocated.append(torch.cuda.memory_allocated()) or tensors,
        )
    output_pointers = [run.outputs[0] for run in runs]
    assert len(output_pointers) == 6 and len(set(output_pointers)) == 1
    assert len(set(allocated[1:])) == 1  # after the first step, every step ends with the same memory in use


def test_final_image_equals_the_cpu_pipelines(tiny_folder):
    from optimum_iobinding import OnnxStableDiffusionPipeline

    cpu = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
    from diffusers import DDIMScheduler

    cpu.scheduler = DDIMScheduler.from_config(cpu.scheduler.config)
    cpu.set_progress_bar_config(disable=True)
    assert np.abs(generate(pipeline(tiny_folder)) - generate(cpu)).max() <= 1e-3


def test_fused_fp16_export_adds_no_error_beyond_fp16_itself(tmp_path, fused_adds_no_error_beyond_fp16):
    """Component by component (a whole random-weights pipeline amplifies fp16 noise step after step): the fused
    fp16 UNet and VAE decoder are as close to the fp32 export as the plain fp16 ones are, give or take fp16 noise."""
    from optimum_iobinding.export import export_pipeline

    folders = {
        "fp32": export_pipeline(None, tmp_path / "fp32", tiny_random=True, progress=False),
        "fp16": export_pipeline(None, tmp_path / "plain", tiny_random=True, fp16=True, progress=False),
        "fused": export_pipeline(
            None, tmp_path / "fused", tiny_random=True, fp16=True, optimize="cuda", progress=False
        ),
    }
    generator = torch.Generator().manual_seed(0)
    inputs = {
        "unet": {
            "sample": torch.randn(2, 4, 8, 8, generator=generator),
            "timestep": torch.full((2,), 500.0),
            "encoder_hidden_states": torch.randn(2, 77, 32, generator=generator),
        },
        "vae_decoder": {"latent_sample": torch.randn(1, 4, 8, 8, generator=generator)},
    }
    for component, feed in inputs.items():
        fused_adds_no_error_beyond_fp16(folders, component, feed)


# ------------------------------------------------------------------------------------------------- reliability
def test_cpu_tensors_for_a_cuda_session_are_copied_and_cuda_tensors_for_a_cpu_session_too(tiny_folder):
    from optimum_iobinding import IOBindingORTModel

    on_gpu = IOBindingORTModel.from_pretrained(tiny_folder, subfolder="unet", provider=CUDA, provider_options=EXACT)
    on_cpu = IOBindingORTModel.from_pretrained(tiny_folder, subfolder="unet")
    cpu_inputs = {name: value.cpu() for name, value in unet_inputs(on_gpu).items()}
    from_cpu = on_gpu(**cpu_inputs)[0]
    from_gpu = on_cpu(**{name: value.cuda() for name, value in cpu_inputs.items()})[0]
    assert from_cpu.device == on_gpu.device and from_gpu.device.type == "cpu"
    torch.testing.assert_close(from_cpu.cpu(), from_gpu, atol=1e-4, rtol=1e-4)


def test_converted_inputs_survive_gc_and_empty_cache_between_bind_and_run(tiny_folder, monkeypatch):
    import gc

    from optimum_iobinding import IOBindingORTModel

    model = IOBindingORTModel.from_pretrained(tiny_folder, subfolder="unet", provider=CUDA, provider_options=EXACT)
    inputs = unet_inputs(model)
    expected = model(**inputs)[0].clone()
    run = model.session.run_with_iobinding

    def collect_then_run(binding, *args):
        gc.collect()
        torch.cuda.empty_cache()
        scribble = [torch.full((1 << 20,), float("nan"), device="cuda") for _ in range(8)]  # reuse freed blocks
        result = run(binding, *args)
        del scribble
        return result

    monkeypatch.setattr(model.session, "run_with_iobinding", collect_then_run)
    double_inputs = {name: value.double() for name, value in inputs.items()}  # each converted to a temporary
    torch.testing.assert_close(model(**double_inputs)[0], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.device_memory
def test_a_thousand_calls_grow_neither_torch_nor_ort_memory(tiny_folder):
    from optimum_iobinding import IOBindingORTModel

    model = IOBindingORTModel.from_pretrained(tiny_folder, subfolder="unet", provider=CUDA)
    inputs = unet_inputs(model)
    for _ in range(100):
        model(**inputs)
    torch.cuda.synchronize()
    torch_before, free_before = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
    for _ in range(1000):
        model(**inputs)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= torch_before  # (a temporary of the first calls may go meanwhile)
    assert abs(torch.cuda.mem_get_info()[0] - free_before) < 2**20  # ORT's arena (device-wide free memory) too


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_shape_changes_mid_session_on_the_gpu(tiny_folder, cuda_graph):
    pipe = pipeline(tiny_folder, cuda_graph=cuda_graph, component_options={"unet": {"max_graph_signatures": 2}})
    for height, width, prompts in [(64, 64, 1), (128, 64, 1), (64, 64, 2), (64, 128, 1), (64, 64, 1)]:
        arguments = dict(
            prompt=["a cat"] * prompts,
            height=height,
            width=width,
            num_inference_steps=3,
            generator=np.random.RandomState(0),
            output_type="np",
        )
        fresh = pipeline(tiny_folder, cuda_graph=False)  # no graph: the reference
        expected = fresh(**dict(arguments, generator=np.random.RandomState(0))).images
        got = pipe(**arguments).images
        assert got.shape == (prompts, height, width, 3)
        assert np.abs(got - expected).max() <= 1e-3
    assert len(pipe.unet.signatures) == 2  # bounded: least recently used signatures were dropped
    assert len(pipe.unet.graph_signatures) == (2 if cuda_graph else 0)


def test_two_pipelines_share_the_gpu_concurrently_and_correctly(tiny_folder):
    from concurrent.futures import ThreadPoolExecutor

    pipes = [pipeline(tiny_folder, cuda_graph=True), pipeline(tiny_folder, cuda_graph=False)]
    serial = [generate(pipe) for pipe in pipes]
    with ThreadPoolExecutor(max_workers=2) as pool:
        threaded = list(pool.map(generate, pipes * 2))
    for index, images in enumerate(threaded):
        assert np.abs(images - serial[index % 2]).max() <= 1e-5


@pytest.mark.device_memory
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_pipeline_on_cuda_1_matches_cuda_0_and_allocates_nothing_on_cuda_0(tiny_folder):
    def used_on_cuda_0():
        free, total = torch.cuda.mem_get_info(0)
        return total - free

    before = used_on_cuda_0()
    on_1 = pipeline(tiny_folder, provider_options={**EXACT, "device_id": "1"})
    images_1 = generate(on_1)
    grown = used_on_cuda_0() - before
    assert on_1.device == torch.device("cuda", 1) and on_1.unet.device == torch.device("cuda", 1)
    images_0 = generate(pipeline(tiny_folder))
    assert np.abs(images_1 - images_0).max() <= 1e-5
    assert grown < 2**20


def test_tiled_vae_with_overlapped_copies_equals_the_sequential_and_the_on_device_results(tiny_folder):
    from optimum_iobinding import IOBindingORTModel, TiledVAE

    decoder = IOBindingORTModel.from_pretrained(
        tiny_folder, subfolder="vae_decoder", provider=CUDA, provider_options=EXACT
    )
    encoder = IOBindingORTModel.from_pretrained(
        tiny_folder, subfolder="vae_encoder", provider=CUDA, provider_options=EXACT
    )
    overlapped = TiledVAE(decoder, encoder, tile_sample_size=64)
    sequential = TiledVAE(decoder, encoder, tile_sample_size=64, overlap_copies=False)
    latents = torch.randn(1, 4, 40, 36, generator=torch.Generator().manual_seed(0)).to("cuda")
    on_device = (overlapped.decode(latents) / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
    streamed = overlapped.decode_to_host(latents)
    np.testing.assert_array_equal(streamed, sequential.decode_to_host(latents))
    np.testing.assert_allclose(streamed, on_device, atol=1e-6)
    image = torch.rand(1, 3, 320, 288, generator=torch.Generator().manual_seed(1)) * 2 - 1
    uploaded = overlapped.encode(image)  # from the host, tile by tile through pinned memory
    torch.testing.assert_close(uploaded, sequential.encode(image), atol=0, rtol=0)
    torch.testing.assert_close(uploaded, overlapped.encode(image.to("cuda")), atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["xl", "lcm"])
def test_sdxl_and_lcm_graph_loops_equal_their_plain_loops(tmp_path, kind):
    from optimum_iobinding import OnnxLatentConsistencyModelPipeline, OnnxStableDiffusionXLPipeline
    from optimum_iobinding.export import export_pipeline

    folder = export_pipeline(None, tmp_path / kind, tiny_random=kind, progress=False)
    pipeline_class = OnnxStableDiffusionXLPipeline if kind == "xl" else OnnxLatentConsistencyModelPipeline
    images = []
    for cuda_graph in (False, True):
        pipe = pipeline_class.from_pretrained(folder, provider=CUDA, provider_options=EXACT, cuda_graph=cuda_graph)
        pipe.set_progress_bar_config(disable=True)
        latents = np.random.RandomState(0).randn(1, 4, SIZE // 8, SIZE // 8).astype(np.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a graph fallback would warn
            # LCM's step adds fresh noise before every step but the last: the same device generator for both runs
            images.append(
                pipe(
                    "a photo of a cat",
                    height=SIZE,
                    width=SIZE,
                    num_inference_steps=4,
                    latents=latents,
                    generator=torch.Generator("cuda").manual_seed(0),
                    output_type="np",
                ).images
            )
    np.testing.assert_allclose(images[1], images[0], atol=1e-4)


# --------------------------------------------------------------------------------------------- fast by default
def test_defaults_capture_every_component_and_equal_the_numpy_loop(tiny_folder, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="optimum_iobinding")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "auto" never warns
        pipe = pipeline(tiny_folder)  # no graph argument
        images = generate(pipe)
    numpy_loop = generate(pipeline(tiny_folder, io_binding=False))
    assert np.abs(images - numpy_loop).max() <= 1e-3
    for name in ("unet", "vae_decoder"):
        assert pipe.onnx_models[name].graph_signatures, (name, pipe.onnx_models[name].graph_fallbacks)
    # a component that keeps a node on the CPU runs without a graph, and "auto" says so once per signature at INFO
    encoder = pipe.onnx_models["text_encoder"]
    assert encoder.graph_signatures or encoder.graph_fallbacks
    fallbacks = [r for r in caplog.records if "no CUDA graph" in r.getMessage()]
    assert all(r.levelname == "INFO" for r in fallbacks) and len(fallbacks) == len(encoder.graph_fallbacks)


def test_a_plain_exports_models_capture_every_batch_in_one_session(tiny_folder):
    # the export computes nothing on the CPU from an input's shape (CLIP: no causal mask from the sequence's length,
    # no arange of the batch to pool with; every attention: its scale a number): ORT accepts one session per model
    # that captures a graph per input shape
    pipe = pipeline(tiny_folder)
    encoder = pipe.onnx_models["text_encoder"]
    for batch in (1, 2, 3):
        ids = torch.full((batch, 77), 3, dtype=encoder.input_dtypes["input_ids"], device=encoder.device)
        ids[:, 5] = pipe.tokenizer.eos_token_id
        encoder(input_ids=ids)
    assert len(encoder.graph_signatures) == 3 and not encoder.graph_fallbacks
    for batch in (1, 2):
        pipe(["a photo of a cat"] * batch, height=SIZE, width=SIZE, num_inference_steps=2, output_type="np")
    for name in ("text_encoder", "unet", "vae_decoder"):
        model = pipe.onnx_models[name]
        assert model.sessions_created == 1 and not model.graph_fallbacks, (name, model.graph_fallbacks)


def test_mixed_batch_sizes_after_warmup_create_no_session_and_keep_every_graph(tiny_folder):
    pipe = pipeline(tiny_folder)
    batches = (1, 4, 8, 2)
    pipe.warmup(heights=SIZE, batch_sizes=list(batches))
    created = pipe.sessions_created
    reference = pipeline(tiny_folder, cuda_graph=False)
    for round_index in range(3):
        for batch in batches:
            arguments = dict(
                prompt=["a cat"] * batch,
                height=SIZE,
                width=SIZE,
                num_inference_steps=3,
                generator=np.random.RandomState(batch),
                output_type="np",
            )
            got = pipe(**arguments).images
            if round_index == 0:
                expected = reference(**dict(arguments, generator=np.random.RandomState(batch))).images
                assert np.abs(got - expected).max() <= 1e-3
    assert pipe.sessions_created == created
    unet_batches = sorted(signature["sample"][0] for signature in pipe.unet.graph_signatures)
    assert unet_batches == [2, 4, 8, 16]  # CFG doubles each batch; every signature kept


def test_every_captured_signature_reads_the_one_copy_of_the_weights(tiny_folder):
    from optimum_iobinding import IOBindingORTModel

    # owned weights (share_weights=True; by default ORT loads them itself where one session holds every graph)
    unet = IOBindingORTModel.from_pretrained(
        tiny_folder, subfolder="unet", provider=CUDA, provider_options=EXACT, share_weights=True
    )
    inputs = {batch: unet_inputs(unet, batch=batch, seed=batch) for batch in (1, 2, 4)}
    with torch.cuda.stream(unet.stream):
        before = {batch: unet(**feed)[0].clone() for batch, feed in inputs.items()}
        sessions = unet.sessions_created
        assert len(unet.graph_signatures) == 3
        weights = list(unet.owned_weights.values())
        assert weights and all(w.device == unet.device for w in weights)
        for weight in weights:
            weight.mul_(0.5)  # in place: the addresses the graphs captured stay the same
        changed = {batch: unet(**feed)[0].clone() for batch, feed in inputs.items()}
        for weight in weights:
            weight.mul_(2.0)
        restored = {batch: unet(**feed)[0].clone() for batch, feed in inputs.items()}
    for batch in inputs:
        assert (changed[batch] - before[batch]).abs().max() > 1e-2  # every graph saw the change
        torch.testing.assert_close(restored[batch], before[batch], atol=1e-4, rtol=1e-4)
    assert unet.sessions_created == sessions


@pytest.mark.device_memory
def test_an_extra_signature_costs_activations_not_another_copy_of_the_weights(tmp_path, make_model):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from optimum_iobinding import IOBindingORTModel

    # 256 MiB of weights, a few KiB of activations: a second signature that loaded the weights again would show
    width = 8192
    weight = numpy_helper.from_array(np.random.RandomState(0).randn(width, width).astype(np.float32), "W")
    path = tmp_path / "wide.onnx"
    onnx.save(
        make_model(
            [helper.make_node("MatMul", ["x", "W"], ["y"])],
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])],
            [weight],
        ),
        str(path),
    )
    model = IOBindingORTModel(path, provider=CUDA, provider_options=EXACT)
    weight_bytes = width * width * 4  # in the one graph session, which loads them itself

    def used():
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free

    model.warmup({"x": (2, width)})
    before = used()
    model.warmup({"x": (1, width)}, {"x": (4, width)})
    grown = used() - before
    assert len(model.graph_signatures) == 3
    # two more signatures grew the device's use by less than one copy of the weights would (each session's own
    # workspace and arena chunk measured 64 MiB on an H100): neither loaded them again
    assert grown < weight_bytes, (grown, weight_bytes)
    assert model.sessions_created == 1 and model.owned_weights == {}
    x = torch.randn(4, width, device="cuda")
    expected = x @ torch.from_numpy(numpy_helper.to_array(weight)).to("cuda")
    torch.testing.assert_close(model(x=x)[0], expected, atol=1e-2, rtol=1e-3)


def test_the_one_graph_session_loads_its_weights_and_own_weights_makes_it_again_around_owned_ones(
    fused_tiny_folder, caplog
):
    import logging

    from optimum_iobinding import IOBindingORTModel

    caplog.set_level(logging.INFO, logger="optimum_iobinding")
    unet = IOBindingORTModel.from_pretrained(fused_tiny_folder, subfolder="unet", provider=CUDA, provider_options=EXACT)
    inputs = {batch: unet_inputs(unet, batch=batch, seed=batch) for batch in (1, 2)}
    with torch.cuda.stream(unet.stream):
        native = {batch: unet(**feed)[0].clone() for batch, feed in inputs.items()}
        # ORT loaded the weights from the file into the one session that holds both graphs: nothing owned
        assert unet.sessions_created == 1 and len(unet.graph_signatures) == 2 and unet.owned_weights == {}
        weights = unet.own_weights()  # what runtime LoRA calls
        assert weights and all(w.device == unet.device for w in weights.values())
        assert unet.graph_signatures == []  # dropped with the session that loaded the weights itself
        owned = {batch: unet(**feed)[0].clone() for batch, feed in inputs.items()}
        assert unet.sessions_created == 2 and len(unet.graph_signatures) == 2  # made again once, both recaptured
        for weight in weights.values():
            weight.mul_(0.5)
        changed = {batch: unet(**feed)[0].clone() for batch, feed in inputs.items()}
    for batch in inputs:
        torch.testing.assert_close(owned[batch], native[batch], atol=1e-4, rtol=1e-4)
        assert (changed[batch] - owned[batch]).abs().max() > 1e-2  # the new graphs read the owned tensors
    assert unet.sessions_created == 2 and unet.own_weights() is weights
    assert len([r for r in caplog.records if "made again around them" in r.getMessage()]) == 1


def test_auto_runs_an_uncapturable_model_without_a_graph_and_logs_why(tmp_path, caplog, make_model):
    import logging

    import onnx
    from onnx import TensorProto, helper

    from optimum_iobinding import IOBindingORTModel

    path = tmp_path / "nonzero.onnx"  # NonZero: an output whose size depends on the data, which no graph replays
    onnx.save(
        make_model(
            [helper.make_node("NonZero", ["x"], ["y"])],
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
            [helper.make_tensor_value_info("y", TensorProto.INT64, [1, "k"])],
        ),
        str(path),
    )
    caplog.set_level(logging.INFO, logger="optimum_iobinding")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model = IOBindingORTModel(path, provider=CUDA)
        (y,) = model(x=torch.tensor([0.0, 1.0, 0.0, 2.0], device="cuda"))
    assert y.cpu().tolist() == [[1, 3]] and model.graph_signatures == []
    assert [r.levelname for r in caplog.records if "no CUDA graph" in r.getMessage()] == ["INFO"]
    with pytest.warns(RuntimeWarning, match="no CUDA graph"):
        IOBindingORTModel(path, provider=CUDA, cuda_graph=True)(x=torch.tensor([1.0], device="cuda"))


def test_alternating_shapes_without_graphs_keep_a_session_per_shape(tiny_folder):
    from optimum_iobinding import IOBindingORTModel

    decoder = IOBindingORTModel.from_pretrained(tiny_folder, subfolder="vae_decoder", provider=CUDA, cuda_graph=False)
    shapes = [(1, 4, 8, 8), (1, 4, 16, 8), (1, 4, 8, 16)]
    for _ in range(3):
        for shape in shapes:
            decoder(latent_sample=torch.randn(shape, device="cuda"))
    assert len(decoder.signatures) == 3 and decoder.graph_signatures == []
    assert decoder.sessions_created == 3  # one per shape, each made once; the dynamic session is never needed


# ------------------------------------------------------------------------- one session, a graph per signature
@pytest.fixture(scope="module")
def fused_tiny_folder(tmp_path_factory):
    from optimum_iobinding.export import export_pipeline

    return export_pipeline(
        None, tmp_path_factory.mktemp("gpu") / "fused", tiny_random=True, optimize="cuda", progress=False
    )


@pytest.mark.parametrize("export", ["fused", "plain"])
def test_signatures_replay_right_after_later_captures(tiny_folder, fused_tiny_folder, export):
    from optimum_iobinding import IOBindingORTModel

    folder = fused_tiny_folder if export == "fused" else tiny_folder
    plain = IOBindingORTModel.from_pretrained(
        folder, subfolder="unet", provider=CUDA, provider_options=EXACT, cuda_graph=False
    )
    unet = IOBindingORTModel.from_pretrained(folder, subfolder="unet", provider=CUDA, provider_options=EXACT)
    batches = (2, 8, 16, 4)
    inputs = {batch: unet_inputs(unet, batch=batch, seed=batch) for batch in batches}
    expected = {batch: plain(**feed)[0].clone() for batch, feed in inputs.items()}
    first = {batch: unet(**feed)[0].clone() for batch, feed in inputs.items()}  # each captured in turn
    assert len(unet.graph_signatures) == len(batches)
    # no node of either export is left on the CPU between CUDA nodes (the plain export's attention scale is a number):
    # one session holds every signature's graph
    assert unet.sessions_created == 1
    for _ in range(2):  # a graph captured early replays right after later captures reused the arena's memory
        for batch, feed in inputs.items():
            got = unet(**feed)[0]
            torch.testing.assert_close(got, expected[batch], atol=1e-4, rtol=1e-4)
            assert torch.equal(got, first[batch])
    assert unet.sessions_created == 1


@pytest.mark.device_memory
def test_signatures_of_one_session_share_its_arena(tmp_path, make_model):
    import onnx
    from onnx import TensorProto, helper

    from optimum_iobinding import IOBindingORTModel

    # no weights, large activations: x (b × 16M floats) → two intermediates of the same size → y
    path = tmp_path / "wide.onnx"
    width = 1 << 24
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Sigmoid", ["a"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["y"]),
    ]
    onnx.save(
        make_model(
            nodes,
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])],
        ),
        str(path),
    )
    model = IOBindingORTModel(path, provider=CUDA)

    def used():
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free

    x = {batch: torch.randn(batch, width, device="cuda") for batch in (4, 1, 2)}
    model(x=x[4])
    before = used()
    results = {batch: model(x=x[batch])[0].clone() for batch in (1, 2)}
    grown = used() - before - sum(t.numel() * t.element_size() * 3 for t in results.values())  # minus the clones'
    # and the two signatures' own output buffers: their intermediates fit in what batch 4 left in the arena
    one_intermediate = width * 4  # of batch 1
    assert model.sessions_created == 1 and len(model.graph_signatures) == 3
    assert grown < one_intermediate, (grown, one_intermediate)
    for batch, result in results.items():
        a = torch.relu(x[batch])
        torch.testing.assert_close(result, a + torch.sigmoid(a))


@pytest.fixture
def cpu_argmax_model_path(make_model, tensor):
    """``cpu_argmax_model_path(folder)``: y = x + x[argmax(ids)] per row, saved in ``folder``: an ArgMax over integers,
    which ORT's CUDA provider keeps on the CPU (what the text encoders of other exporters do to pool CLIP's end
    token)."""

    def save(folder):
        import onnx
        from onnx import TensorProto, helper

        model = make_model(
            [
                helper.make_node("Cast", ["ids"], ["ids32"], to=TensorProto.INT32),
                helper.make_node("ArgMax", ["ids32"], ["position"], axis=1, keepdims=1),
                helper.make_node("GatherElements", ["x", "position"], ["picked"], axis=1),
                helper.make_node("Add", ["x", "picked"], ["y"]),
            ],
            [tensor("x", TensorProto.FLOAT, ["batch", 8]), tensor("ids", TensorProto.INT64, ["batch", 8])],
            [tensor("y", TensorProto.FLOAT, ["batch", 8])],
        )
        path = folder / "cpu_argmax.onnx"
        onnx.save(model, str(path))
        return path

    return save


def test_a_model_ort_cannot_capture_as_one_session_gets_a_session_per_signature_and_says_why(
    tmp_path, caplog, cpu_argmax_model_path
):
    import logging

    from optimum_iobinding import IOBindingORTModel

    caplog.set_level(logging.INFO, logger="optimum_iobinding")
    path = cpu_argmax_model_path(tmp_path)
    model = IOBindingORTModel(path, provider=CUDA, provider_options=EXACT)
    plain = IOBindingORTModel(path, provider=CUDA, provider_options=EXACT, cuda_graph=False)
    for batch in (1, 2, 1):
        generator = torch.Generator().manual_seed(batch)
        x = torch.randn(batch, 8, generator=generator).to("cuda")
        ids = torch.randint(0, 100, (batch, 8), generator=generator).to("cuda")
        torch.testing.assert_close(model(x=x, ids=ids)[0], plain(x=x, ids=ids)[0])
    refused = [r for r in caplog.records if "one session cannot capture" in r.getMessage()]
    assert len(refused) == 1 and refused[0].levelname == "INFO"  # said once, not per signature
    assert model.sessions_created == 2 and len(model.signatures) == 2  # one per signature, each made once
    # refused twice, then never again: the one graph session, and a graph of the first signature's fixed shape
    # (the ArgMax stays on the CPU); the second signature goes straight to a session without a graph
    assert [what for what, _ in model.session_creation_log] == ["refused", "refused", "session", "session"]
    # a later load of the same file does not ask ORT for the one graph session again (remembered per file)
    again = IOBindingORTModel(path, provider=CUDA, provider_options=EXACT)
    x, ids = torch.randn(1, 8).to("cuda"), torch.randint(0, 100, (1, 8)).to("cuda")
    torch.testing.assert_close(again(x=x, ids=ids)[0], plain(x=x, ids=ids)[0])
    assert [what for what, _ in again.session_creation_log] == ["refused", "session"]  # the fixed-shape graph's


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_the_exported_text_encoder_is_captured_as_a_cuda_graph_for_every_batch_size(tmp_path, fp16):
    # the export pools CLIP's end token with a gather and masks attention inside one causal MultiHeadAttention, so no
    # node is left on the CPU: every batch size is captured as a CUDA graph of one session, and gives what it gives
    # without graphs
    from optimum_iobinding import IOBindingORTModel
    from optimum_iobinding.export import export_pipeline

    folder = export_pipeline(None, tmp_path / "sd", tiny_random=True, fp16=fp16, progress=False)
    encoder = IOBindingORTModel.from_pretrained(folder, subfolder="text_encoder", provider=CUDA, provider_options=EXACT)
    plain = IOBindingORTModel.from_pretrained(
        folder, subfolder="text_encoder", provider=CUDA, provider_options=EXACT, cuda_graph=False
    )
    for batch in (1, 2, 1, 2):
        ids = torch.randint(0, 100, (batch, 77), generator=torch.Generator().manual_seed(batch)).to("cuda")
        ids = ids.to(encoder.input_dtypes["input_ids"])
        for got, expected in zip(encoder(input_ids=ids), plain(input_ids=ids)):
            torch.testing.assert_close(got, expected, atol=1e-3 if fp16 else 1e-4, rtol=1e-3)
    assert [what for what, _ in encoder.session_creation_log] == ["session"]
    assert len(encoder.graph_signatures) == 2 and encoder.graph_fallbacks == {}


def test_a_graph_pool_model_parses_its_file_once(tiny_folder, monkeypatch):
    # a model that owns its weights (share_weights=True) reads its declared inputs from one parse, and its owned
    # weights load from that same parse
    import onnx

    from optimum_iobinding import IOBindingORTModel
    from optimum_iobinding.runtime import weights as session_module

    parses = []
    monkeypatch.setattr(session_module, "parse_model", lambda source: parses.append(source) or onnx.load(source))
    encoder = IOBindingORTModel.from_pretrained(
        tiny_folder, subfolder="text_encoder", provider=CUDA, provider_options=EXACT, share_weights=True
    )
    plain = IOBindingORTModel.from_pretrained(
        tiny_folder,
        subfolder="text_encoder",
        provider=CUDA,
        provider_options=EXACT,
        cuda_graph=False,
        share_weights=False,
    )
    ids = torch.randint(0, 100, (1, 77), generator=torch.Generator().manual_seed(0)).to("cuda")
    ids = ids.to(encoder.input_dtypes["input_ids"])
    torch.testing.assert_close(encoder(input_ids=ids)[0], plain(input_ids=ids)[0], atol=1e-4, rtol=1e-4)
    assert encoder.owned_weights and parses == []


@pytest.mark.parametrize("staging_bytes", [1 << 16, 64 << 20])  # buffers refilled many times; the default
@pytest.mark.parametrize("storage", ["inline", "external"])  # in the .onnx; in a weights file, read straight from it
def test_weights_uploaded_through_pinned_staging_equal_the_files(
    tiny_folder, tiny_unet_external, staging_bytes, storage
):
    from optimum_iobinding.runtime.weights import load_owned_weights

    inline = str(tiny_folder / "unet" / "model.onnx")
    path = str(tiny_unet_external) if storage == "external" else inline
    on_cpu = load_owned_weights(inline, torch.device("cpu"))  # from the model's bytes either way
    on_gpu = load_owned_weights(path, torch.device("cuda", 0), staging_bytes=staging_bytes)
    assert list(on_gpu) == list(on_cpu) and len(on_gpu) > 10
    for name, tensor in on_cpu.items():
        assert on_gpu[name].device.type == "cuda" and torch.equal(on_gpu[name].cpu(), tensor), name


def test_the_load_builds_the_shape_free_sessions_in_the_background(fused_tiny_folder):
    pipe = pipeline(fused_tiny_folder)
    for name in ("text_encoder", "unet", "vae_decoder"):  # started by the load: prepare waits for its thread
        assert getattr(pipe, name).prepare(wait=True) is None
        assert getattr(pipe, name).sessions_created == 1
    assert pipe.vae_encoder.sessions_created == 0  # a text-to-image call never runs it
    images = generate(pipe)
    assert pipe.sessions_created == 3
    numpy_loop = generate(pipeline(fused_tiny_folder, io_binding=False))
    assert np.abs(images - numpy_loop).max() <= 1e-3


def test_without_background_preparation_every_session_and_first_run_is_made_when_the_calling_thread_needs_it(
    fused_tiny_folder,
):
    from optimum_iobinding.runtime import timeline

    with timeline.recording() as record:
        pipe = pipeline(fused_tiny_folder, prepare_in_background=False)
        images = generate(pipe)
    threads = {step.thread for step in record.steps}
    assert threads == {threading.current_thread().name}, sorted(threads)
    assert any(step.what.startswith("session") for step in record.steps)
    assert pipe.sessions_created == 3 and pipe.vae_encoder.sessions_created == 0
    assert np.abs(images - generate(pipeline(fused_tiny_folder))).max() <= 1e-5


def test_every_session_is_made_and_run_on_one_thread_whichever_threads_prepare_and_call(fused_tiny_folder, monkeypatch):
    # ORT's CUDA provider keeps a context (cuBLAS/cuDNN handles and their device memory) per thread that makes or runs
    # a session: sessions built in set-up threads, first-run beside the loop and called from the caller's thread (and
    # a server's) held one per thread; a session thread keeps it at one per session
    import onnxruntime as ort

    from optimum_iobinding.runtime import session as session_module

    threads = {}  # id(session) -> threads that made or ran it
    made = session_module.create_session

    def create(*args, **kwargs):
        created = made(*args, **kwargs)
        threads.setdefault(id(created), set()).add(threading.get_ident())
        return created

    run = ort.InferenceSession.run_with_iobinding

    def run_recorded(self, *args, **kwargs):
        threads.setdefault(id(self), set()).add(threading.get_ident())
        return run(self, *args, **kwargs)

    monkeypatch.setattr(session_module, "create_session", create)
    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", run_recorded)
    pipe = pipeline(fused_tiny_folder)
    first = generate(pipe)
    result = {}
    other = threading.Thread(target=lambda: result.setdefault("images", generate(pipe)))
    other.start()
    other.join(600)
    assert len(threads) == pipe.sessions_created == 3
    assert all(len(seen) == 1 for seen in threads.values()), threads
    assert threading.get_ident() not in set().union(*threads.values())
    assert np.abs(result["images"] - first).max() <= 1e-5


SHARED_ARENA_SCRIPT = """
import json, sys
import numpy as np
import torch
from diffusers import DDIMScheduler
from optimum_iobinding import OnnxStableDiffusionPipeline
from optimum_iobinding.runtime.shared_arena import SHARED_ARENAS

def load(**kwargs):
    pipe = OnnxStableDiffusionPipeline.from_pretrained(
        sys.argv[1], provider="CUDAExecutionProvider", provider_options={"use_tf32": "0"}, **kwargs)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe

def calls(pipe):
    image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    img2img = pipe.image_to_image()
    return [
        pipe("a cat", height=64, width=64, num_inference_steps=4, generator=np.random.RandomState(0),
             output_type="np", num_images_per_prompt=batch).images
        for batch in (1, 3)
    ] + [
        img2img("a dog", image=image, strength=0.75, num_inference_steps=4, generator=np.random.RandomState(1),
                output_type="np").images
    ]

pipe = load(prepare_in_background=False)
for name in ("text_encoder", "unet", "vae_decoder"):
    getattr(pipe, name).prepare()  # made before any capture, each
members = SHARED_ARENAS.members(0)
first = calls(pipe)
again = calls(pipe)
third = calls(pipe)
plain = calls(load(cuda_graph=False))
models = {name: getattr(pipe, name) for name in ("text_encoder", "unet", "vae_decoder", "vae_encoder")}
print(json.dumps({
    "members_at_load": members,
    "members": SHARED_ARENAS.members(0),
    "joined": SHARED_ARENAS.joined_count(0),
    "uncaptured": {name: len(m.signatures) - len(m.graph_signatures) for name, m in models.items()},
    "vs_plain": max(float(np.abs(a - b).max()) for a, b in zip(first, plain)),
    "second": max(float(np.abs(a - b).max()) for a, b in zip(first, again)),
    "replays": max(float(np.abs(a - b).max()) for a, b in zip(again, third)),
}))
"""


def test_a_pipelines_sessions_share_one_arena_and_a_session_made_after_a_capture_keeps_its_own(fused_tiny_folder):
    # one arena for the text encoder's, the UNet's and the VAE decoder's graph sessions (made before any capture); the
    # VAE encoder's, made by the first image-to-image call after graphs were captured in the arena, keeps its own (its
    # prepacked weights could otherwise land in memory a graph replays into). A fresh process: the arena is the
    # process's
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", SHARED_ARENA_SCRIPT, str(fused_tiny_folder)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["members_at_load"] == 3 and result["members"] == 3 and result["joined"] == 3, result
    assert result["uncaptured"] == {"text_encoder": 0, "unet": 0, "vae_decoder": 0, "vae_encoder": 0}, result
    # a signature's first step runs without a graph and the later ones replay it: the second call differs from the
    # first by rounding (1.2e-5 on the GPU, with each session's own arena alike), and every replay after it is equal
    assert result["vs_plain"] <= 1e-3 and result["second"] <= 1e-4 and result["replays"] == 0.0, result


def test_a_signature_prepared_in_the_background_is_captured_by_its_first_call(tiny_folder):
    from optimum_iobinding import IOBindingORTModel

    decoder = IOBindingORTModel.from_pretrained(
        tiny_folder, subfolder="vae_decoder", provider=CUDA, provider_options=EXACT
    )
    plain = IOBindingORTModel.from_pretrained(
        tiny_folder, subfolder="vae_decoder", provider=CUDA, provider_options=EXACT, cuda_graph=False
    )
    shape = (1, decoder.input_dims["latent_sample"][1], 8, 8)
    thread = decoder.prepare_signature({"latent_sample": shape})
    thread.join()
    assert decoder.prepare_signature({"latent_sample": shape}) is None  # made already
    runner = decoder.graph_runner({"latent_sample": shape})  # its run without a graph made, its capture not yet
    assert decoder.sessions_created == 1 and runner is not None and runner.runs == 0
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to("cuda")
    first = decoder(latent_sample=latents)[0].clone()
    again = decoder(latent_sample=latents * 0.5)[0].clone()
    assert decoder.graph_runner({"latent_sample": shape}) is runner and runner.runs == 2
    assert len(decoder.graph_signatures) == 1 and decoder.sessions_created == 1
    torch.testing.assert_close(first, plain(latent_sample=latents)[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(again, plain(latent_sample=latents * 0.5)[0], atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------ runtime LoRA
@pytest.mark.parametrize("export", ["fused", "plain"])
def test_captured_graphs_replay_lora_weights_and_switching_creates_no_session(
    tiny_folder, fused_tiny_folder, export, tmp_path, make_lora
):
    from optimum_iobinding.export.tiny import TINY_RANDOM_KINDS

    make_lora(TINY_RANDOM_KINDS["sd"](), tmp_path / "lora", 5, ["to_q", "to_k", "to_v", "to_out.0"], ["q_proj", "fc1"])
    folder = fused_tiny_folder if export == "fused" else tiny_folder
    graphs = pipeline(folder)  # the defaults: graphs where ORT captures them
    base = generate(graphs)
    before = {name: getattr(graphs, name).sessions_created for name in ("unet", "text_encoder")}
    graphs.load_lora_weights(str(tmp_path / "lora"), adapter_name="x")
    with_lora = generate(graphs)
    created = {name: getattr(graphs, name).sessions_created for name in ("unet", "text_encoder", "vae_decoder")}
    # the first LoRA makes the weights owned: each component whose one graph session had loaded them itself (the UNet
    # and the text encoder, of either export) makes it again around them, once
    assert created["unet"] - before["unet"] == 1
    assert created["text_encoder"] - before["text_encoder"] == 1 and graphs.unet.owned_weights
    graphs.disable_lora()
    disabled = generate(graphs)
    graphs.enable_lora()
    assert np.abs(generate(graphs) - with_lora).max() <= 1e-5
    # the weights changed under the captured graphs: nothing was created again
    assert {name: getattr(graphs, name).sessions_created for name in created} == created
    assert graphs.unet.graph_signatures
    fresh = pipeline(folder, cuda_graph=False)
    fresh.load_lora_weights(str(tmp_path / "lora"), adapter_name="x")
    assert np.abs(with_lora - generate(fresh)).max() <= 1e-3
    assert np.abs(with_lora - base).max() > 1e-3 and np.abs(disabled - base).max() <= 1e-5


# -------------------------------------------------------------------------------------------------- ControlNet
def controlnet_pipeline(folder, **kwargs):
    from diffusers import DDIMScheduler

    from optimum_iobinding import OnnxStableDiffusionControlNetPipeline

    kwargs.setdefault("provider_options", EXACT)
    pipe = OnnxStableDiffusionControlNetPipeline.from_pretrained(folder, **kwargs)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize(
    "net, kwargs",
    [
        ("one", {}),
        ("one", {"guess_mode": True, "control_guidance_start": 0.25}),
        ("two", {"controlnet_conditioning_scale": [0.7, 1.2], "control_guidance_end": [0.5, 1.0]}),
    ],
)
def test_controlnet_graphs_equal_the_cpu_pipeline_and_the_host_never_waits(controlnet_folders, net, kwargs):
    count = 1 if net == "one" else 2
    images = [torch.rand(1, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(3 + k)) for k in range(count)]
    image = images[0] if count == 1 else images

    def generate_with(pipe):
        return pipe(
            "a photo of a cat",
            image=image,
            num_inference_steps=4,
            generator=np.random.RandomState(0),
            output_type="np",
            **kwargs,
        ).images

    graphs = controlnet_pipeline(controlnet_folders[net], provider=CUDA)
    expected = generate_with(controlnet_pipeline(controlnet_folders[net], provider="CPUExecutionProvider"))
    # CUDA's fp32 kernels against the CPU's (no TF32): rounding, not a different computation
    np.testing.assert_allclose(generate_with(graphs), expected, atol=1e-3)
    for name in ("unet", "controlnet"):
        assert getattr(graphs, name).graph_signatures, f"{name} was not captured"
    created = graphs.sessions_created
    # the loop with the ControlNets' residuals made each step: enqueued without one host wait
    with torch.cuda.stream(graphs.stream):
        embeds = graphs.encode_prompt("a photo of a cat", 1, True)
        latents = graphs.prepare_latents((1, 4, SIZE // 8, SIZE // 8), embeds.dtype, np.random.RandomState(0))
        guess = kwargs.get("guess_mode", False)
        prepared = graphs.prepare_control_images(image, "image", None, None, 1, 1, True, guess)

        def loop():
            timesteps = graphs.set_timesteps(4)
            scales, starts, ends = graphs.check_control_arguments(
                kwargs.get("controlnet_conditioning_scale", 1.0),
                kwargs.get("control_guidance_start", 0.0),
                kwargs.get("control_guidance_end", 1.0),
            )
            residuals = graphs.controlnet_step_inputs(prepared, timesteps, scales, starts, ends, guess, True)
            return denoise(
                graphs.denoiser,
                latents,
                timesteps,
                tensors={"prompt_embeds": embeds},
                guidance=Guidance.classifier_free(7.5),
                step_kwargs=graphs.scheduler_step_kwargs(None, 0.0),
                step_inputs=residuals,
            )

        loop()
        torch.cuda.synchronize()
        waits = host_waits(loop)
    assert waits == [], "\n".join(f"{waits.count(w)}× {w}" for w in sorted(set(waits)))
    assert graphs.sessions_created == created
    torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------------ serving
def test_served_batches_queue_behind_each_other_on_the_gpu_and_equal_single_calls(tiny_folder):
    """A replica on CUDA puts a batch on the GPU and starts the next before the first's images are back
    (ImageGenerator.start_batch / finish_batch, what Serve's batch handler runs): both equal single calls."""
    pytest.importorskip("ray.serve")
    from dataclasses import asdict

    from optimum_iobinding.serve import ImageGenerator, ServeConfig

    generator = ImageGenerator(
        asdict(
            ServeConfig(
                model=str(tiny_folder),
                device="cuda",
                max_batch_size=2,
                steps=4,
                warmup_sizes=[SIZE],
                warmup_batch_sizes=[1, 2],
            )
        )
    )
    assert generator.defers_images and generator.admission.max_unfinished == 2
    from optimum_iobinding.serve import QUEUED_REGROUP_WAIT

    generator.expect_return(2, 1.0)  # the next batch queues behind this one: it waits longer for its group
    assert generator.batch_limits == pytest.approx((2, QUEUED_REGROUP_WAIT))
    requests = [
        generator.complete_request(dict(prompt=prompt, seed=seed, size=SIZE))
        for prompt, seed in (("a red house", 1), ("a green tree", 2), ("a blue boat", 3))
    ]
    first = generator.start_batch(requests[:2])
    second = generator.start_batch(requests[2:])  # queued on the GPU behind the first
    batched = generator.finish_batch(first) + generator.finish_batch(second)
    assert [result["batch_images"] for result in batched] == [2, 2, 1]
    for request, result in zip(requests, batched):
        (alone,) = generator.run_batch([request])
        assert np.abs(result["images"][0].astype(int) - alone["images"][0].astype(int)).max() <= 1
        assert result["pipeline_s"] > 0


@pytest.mark.parametrize("cuda_graph", [True, False])
def test_a_stochastic_scheduler_reproduces_from_one_seed_on_the_device(tiny_folder, cuda_graph):
    from diffusers import EulerAncestralDiscreteScheduler

    pipe = pipeline(tiny_folder, cuda_graph=cuda_graph)
    pipe.scheduler = EulerAncestralDiscreteScheduler.from_config(pipe.scheduler.config)
    first, again = generate(pipe), generate(pipe)
    assert np.array_equal(first, again)  # the step's noise is drawn from the seed, not from torch's global state
    torch.manual_seed(1234)  # the global generators moved: the image must not
    assert np.array_equal(generate(pipe), first)
    assert np.abs(generate(pipe, seed=1) - first).max() > 1e-3  # another seed, another image
