"""A probe, not part of the project: which way of sharing activation memory across the CUDA graphs of one model's
input signatures stays correct? Modes:
  own      the runtime's IOBindingORTModel as it is (when the probe was written: a session per signature, each with
           its own arena; since then: one session with a gpu_graph_id per signature where ORT allows it)
  env      a session per signature (its free dims fixed, enable_cuda_graph), all on ORT's environment arena
           (create_and_register_allocator_v2 + the session config entry session.use_env_allocators)
  route-a  one session with dynamic dims, enable_cuda_graph, a gpu_graph_id per signature
Every output is compared with a plain dynamic session (no graph) on the same inputs, right after its capture and in
two later rounds of replays. Results: benchmarks/results/h100/2026-11-23-892cff2 (graph-memory-routes.jsonl).

    python benchmarks/graph_memory_routes.py FOLDER SIZE BATCHES     e.g. WORK/small-fp16-optimized 256 2,8,16,4
"""

import json
import os
import subprocess
import sys
import torch
import onnxruntime as ort
from optimum_iobinding.runtime.dtypes import ORT_TO_TORCH, TORCH_TO_ONNX


def used():
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def make_inputs(session, b, size):
    feeds = {}
    for i in session.get_inputs():
        dt = ORT_TO_TORCH[i.type]
        g = torch.Generator(device="cuda").manual_seed(b * 10 + len(feeds))
        if i.name == "sample":
            feeds[i.name] = torch.randn((b, 4, size // 8, size // 8), generator=g, device="cuda").to(dt)
        elif i.name == "timestep":
            feeds[i.name] = torch.full((b,) if i.shape else (), 500, device="cuda").to(dt)
        else:
            feeds[i.name] = torch.randn((b, 77, i.shape[2]), generator=g, device="cuda").to(dt)
    return feeds


def bound(session, feeds, out):
    """An IOBinding of ``session`` to the tensors ``feeds`` (inputs by name) and ``out`` (its first output)."""
    bind = session.io_binding()
    for n, t in feeds.items():
        bind.bind_input(n, "cuda", 0, TORCH_TO_ONNX[t.dtype], list(t.shape), t.data_ptr())
    bind.bind_output(
        session.get_outputs()[0].name, "cuda", 0, TORCH_TO_ONNX[out.dtype], list(out.shape), out.data_ptr()
    )
    return bind


def run_bound(session, feeds, out, ro):
    session.run_with_iobinding(bound(session, feeds, out), ro)
    torch.cuda.synchronize()


def one(folder, mode, size, batches):
    path = os.path.join(folder, "unet", "model.onnx")
    torch.cuda.init()
    idle = used()
    ref_session = ort.InferenceSession(path, providers=["CUDAExecutionProvider"])
    refs, feeds = {}, {}
    for b in batches:
        feeds[b] = make_inputs(ref_session, b, size)
        out = torch.empty((b, 4, size // 8, size // 8), dtype=feeds[b]["sample"].dtype, device="cuda")
        run_bound(ref_session, feeds[b], out, ort.RunOptions())
        refs[b] = out.float().clone()
    declared = {i.name: i.shape for i in ref_session.get_inputs()}
    del ref_session
    base = used() - idle
    res = {"mode": mode, "base_mib": base, "rows": [], "later": {}}

    def diff(b, out):
        return float((out.float() - refs[b]).abs().max())

    if mode == "route-a":
        try:
            s = ort.InferenceSession(path, providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
        except Exception as e:
            res["error"] = str(e)[:2000]
            return res
        outs = {}
        for gid, b in enumerate(batches, 1):
            ro = ort.RunOptions()
            ro.add_run_config_entry("gpu_graph_id", str(gid))
            outs[b] = (torch.empty_like(refs[b], dtype=feeds[b]["sample"].dtype), ro)
            bind = s.io_binding()
            for n, t in feeds[b].items():
                bind.bind_input(n, "cuda", 0, TORCH_TO_ONNX[t.dtype], list(t.shape), t.data_ptr())
            o = outs[b][0]
            bind.bind_output(s.get_outputs()[0].name, "cuda", 0, TORCH_TO_ONNX[o.dtype], list(o.shape), o.data_ptr())
            outs[b] = (o, ro, bind)
            errs = []
            for _ in range(4):
                s.run_with_iobinding(bind, ro)
                torch.cuda.synchronize()
                errs.append(diff(b, o))
            res["rows"].append({"batch": b, "used_mib": used() - idle, "diffs": errs})
        for rnd in range(2):
            for b in batches:
                o, ro, bind = outs[b]
                o.zero_()
                s.run_with_iobinding(bind, ro)
                torch.cuda.synchronize()
                res["later"][f"{rnd}-{b}"] = diff(b, o)
        return res
    if mode == "env":
        # the sessions are made here: the runtime's sessions take no session config entries from the caller
        mi = ort.OrtMemoryInfo("Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator_v2(
            "CUDAExecutionProvider", mi, {"device_id": "0"}, ort.OrtArenaCfg(0, 1, -1, -1)
        )
        graphs = {}
        for b in batches:
            so = ort.SessionOptions()
            so.add_session_config_entry("session.use_env_allocators", "1")
            for name, shape in declared.items():  # the free dims fixed to this signature's sizes
                for k, dim in enumerate(shape):
                    if isinstance(dim, str):
                        so.add_free_dimension_override_by_name(dim, feeds[b][name].shape[k])
            try:
                s = ort.InferenceSession(path, so, providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
            except Exception as e:
                res["error"] = str(e)[:2000]
                return res
            o = torch.empty_like(refs[b], dtype=feeds[b]["sample"].dtype)
            bind, ro = bound(s, feeds[b], o), ort.RunOptions()
            graphs[b] = (s, bind, ro, o)
            errs = []
            for _ in range(4):
                s.run_with_iobinding(bind, ro)
                torch.cuda.synchronize()
                errs.append(diff(b, o))
            res["rows"].append({"batch": b, "used_mib": used() - idle, "diffs": errs})
        for rnd in range(2):
            for b in batches:
                s, bind, ro, o = graphs[b]
                o.zero_()
                s.run_with_iobinding(bind, ro)
                torch.cuda.synchronize()
                res["later"][f"{rnd}-{b}"] = diff(b, o)
        return res
    from optimum_iobinding import IOBindingORTModel

    unet = IOBindingORTModel.from_pretrained(folder, subfolder="unet", provider="CUDAExecutionProvider")
    for b in batches:
        errs = [diff(b, unet(**feeds[b])[0]) for _ in range(4)]
        res["rows"].append({"batch": b, "used_mib": used() - idle, "diffs": errs})
    for rnd in range(2):
        for b in batches:
            res["later"][f"{rnd}-{b}"] = diff(b, unet(**feeds[b])[0])
    return res


if __name__ == "__main__":
    folder, size, batches = sys.argv[1], int(sys.argv[2]), [int(b) for b in sys.argv[3].split(",")]
    if len(sys.argv) > 4:
        print("RESULT " + json.dumps(one(folder, sys.argv[4], size, batches)))
        sys.exit(0)
    for mode in ("route-a", "env", "own"):
        p = subprocess.run(
            [sys.executable, __file__, folder, str(size), sys.argv[3], mode], capture_output=True, text=True
        )
        lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        print(lines[-1][7:] if lines else json.dumps({"mode": mode, "error": p.stderr[-3000:]}), flush=True)
