"""The device memory an ONNX Runtime CUDA session holds per thread that uses it: the CUDA execution provider makes a
context for each thread (its cuBLAS, cuBLASLt and cuDNN handles and what they allocate) and keeps it after the thread
ends, for a later thread. The pipelines build sessions in threads as they load and make a first run of the VAE
decoder beside the loop; ``benchmarks/pipeline_memory.py --arena-log`` counts the contexts ORT makes
("PerThreadContext" lines). This measures what one costs, with :func:`cold_start.library_model` (a Conv, a MatMul and
a MultiHeadAttention in fp16) and the library's default CUDA provider options:
- a session built in the main thread, then its first run there;
- a second session built in a thread of its own, then run in the main thread;
- the first session run once in each of ``--threads`` threads alive together, then after they end;
- a third session built and run in the main thread after all that.

Device memory is device-wide used memory (NVML where it finds the device) in MiB above the process's idle, its CUDA
context made; ORT's INFO log of the run is kept in ``OUT/ort.log`` (its "PerThreadContext" lines counted).

    python benchmarks/thread_contexts.py --out OUT/thread-contexts
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def measure(threads: int) -> dict:
    import numpy as np
    import onnxruntime as ort
    import torch

    from cold_start import library_model
    from optimum_iobinding.bench.probes import PeakMemory
    from optimum_iobinding.runtime.cuda_policy import CUDA_DIFFUSION_DEFAULTS

    ort.set_default_logger_severity(1)
    torch.zeros(1, device="cuda")  # the process's CUDA context made: idle is measured with it
    torch.cuda.synchronize()
    probe = PeakMemory(torch.device("cuda", 0))
    idle = probe.used()
    steps = []

    def note(what: str) -> None:
        torch.cuda.synchronize()
        steps.append({"after": what, "used_mib": round((probe.used() - idle) / 2**20, 1)})
        print(f"== {what}", file=sys.stderr, flush=True)

    model = library_model()
    providers = [("CUDAExecutionProvider", dict(CUDA_DIFFUSION_DEFAULTS))]
    feed = {"x": np.ones((1, 4, 64, 64), np.float16)}
    note("idle")
    first = ort.InferenceSession(model, providers=providers)
    note("session built in the main thread")
    first.run(None, feed)
    note("its first run in the main thread")
    built = []
    builder = threading.Thread(target=lambda: built.append(ort.InferenceSession(model, providers=providers)))
    builder.start()
    builder.join()
    note("a second session built in a thread, the thread ended")
    built[0].run(None, feed)
    note("the second session run in the main thread")
    barrier = threading.Barrier(threads + 1)

    def run_and_wait() -> None:
        first.run(None, feed)
        barrier.wait()  # every thread alive until each has run
        barrier.wait()

    workers = [threading.Thread(target=run_and_wait) for _ in range(threads)]
    for worker in workers:
        worker.start()
    barrier.wait()
    note(f"the first session run in {threads} threads alive together")
    barrier.wait()
    for worker in workers:
        worker.join()
    note("those threads ended")
    again = [threading.Thread(target=lambda: first.run(None, feed)) for _ in range(threads)]
    for worker in again:
        worker.start()
        worker.join()
    note(f"the first session run in {threads} more threads, one after another")
    third = ort.InferenceSession(model, providers=providers)
    third.run(None, feed)
    note("a third session built and run in the main thread")
    return {"threads": threads, "steps": steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads < 1:
        parser.error(f"--threads: expected a positive count, got {args.threads}")
    out = Path(args.out)
    if args.child:
        print(json.dumps(measure(args.threads)))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, __file__, "--out", str(out), "--threads", str(args.threads), "--child"]
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
    (out / "ort.log").write_text(done.stderr)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return done.returncode
    result = json.loads(done.stdout.strip().splitlines()[-1])
    contexts, counts = 0, {}
    for line in done.stderr.splitlines():
        if line.startswith("== "):
            counts[line[3:]] = contexts
        elif "PerThreadContext" in line:
            contexts += 1
    for step in result["steps"]:
        step["thread_contexts_so_far"] = counts.get(step["after"])
    result["command"] = " ".join(sys.argv)
    (out / "thread-contexts.json").write_text(json.dumps(result, indent=1))
    for step in result["steps"]:
        print(f"{step['used_mib']:>8} MiB  {step['thread_contexts_so_far']!s:>3} contexts  {step['after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
