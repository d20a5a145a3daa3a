"""Whether an attention shape's set-up in ONNX Runtime's CUDA provider carries over to another session or thread: the
question behind the UNet's first run, whose MultiHeadAttention nodes spend 56–64 ms each there, building cuDNN's plans
(``benchmarks/results/h200/2026-12-03-62f8944``). ORT keeps each cuDNN attention graph it builds per thread and cuDNN
handle, so no session reuses another's graphs. What cuDNN and the driver keep (kernel modules loaded, kernels
compiled, heuristics) would carry over; then a pipeline could set the attention shapes up ahead, beside its UNet.

For each attention shape of SD 1.5's UNet at 512² with classifier-free guidance (batch 2, 8 heads; self-attention on
packed QKV, cross-attention on a query and packed KV of 77 tokens), in one fresh process, in this order:

- ``first``: a session holding that one ``MultiHeadAttention`` node, its first run, in thread 1;
- ``again``: the same session's second run (what a run costs once set up);
- ``thread``: a new session, its first run in thread 2;
- ``session``: a new session, its first run in thread 1.

Each row also gives the three sessions' creation seconds. ``first`` far above ``thread`` and ``session`` says the set-up
carries over; all three alike says it does not. The first shape's ``first`` also holds what any first attention run
loads once a process.

    python benchmarks/attention_setup.py --out OUT/attention-setup [--sdpa-kernel 8] [--provider cpu]

``--provider cpu`` checks the script on a machine without CUDA, with the query, key and value apart (ORT's CPU kernel
takes no packed QKV): its seconds mean nothing.
Writes ``attention-setup.json`` into ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

HEADS = 8
BATCH = 2  # classifier-free guidance: the negative and the positive prompt in one call
TEXT_TOKENS = 77
# (tokens, head size) of SD 1.5's UNet at 512²: 64², 32², 16² latents and the middle block's 8², 320 to 1280 channels
SHAPES = ((4096, 40), (1024, 80), (256, 160), (64, 160))


def attention_model(kind: str, tokens: int, head_size: int, packed: bool = True) -> bytes:
    """One fp16 ``MultiHeadAttention`` node as ORT's fused UNet holds it: ``self`` on packed QKV ``[B, S, N, 3, H]``,
    ``cross`` on a query ``[B, S, N·H]`` and packed KV ``[B, 77, N, 2, H]``. ``packed=False``: a query, a key and a
    value ``[B, tokens, N·H]`` each (ORT's CPU kernel takes no packed QKV)."""
    from onnx import TensorProto, helper

    hidden = HEADS * head_size
    if not packed:
        keys = tokens if kind == "self" else TEXT_TOKENS
        inputs = [
            helper.make_tensor_value_info(name, TensorProto.FLOAT16, [BATCH, length, hidden])
            for name, length in (("q", tokens), ("k", keys), ("v", keys))
        ]
    elif kind == "self":
        inputs = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT16, [BATCH, tokens, HEADS, 3, head_size])]
    else:
        inputs = [
            helper.make_tensor_value_info("q", TensorProto.FLOAT16, [BATCH, tokens, hidden]),
            helper.make_tensor_value_info("kv", TensorProto.FLOAT16, [BATCH, TEXT_TOKENS, HEADS, 2, head_size]),
        ]
    node = helper.make_node(
        "MultiHeadAttention", [value.name for value in inputs], ["y"], domain="com.microsoft", num_heads=HEADS
    )
    graph = helper.make_graph(
        [node],
        f"{kind}-{tokens}-{head_size}",
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [BATCH, tokens, hidden])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 8  # what every ONNX Runtime since 1.10 reads
    return model.SerializeToString()


def feed_of(session) -> Dict[str, Any]:
    """Zeros for each of the session's inputs (their shapes are all fixed)."""
    import numpy as np

    return {value.name: np.zeros(value.shape, np.float16) for value in session.get_inputs()}


def timed(work: Callable[[], Any]) -> Tuple[Any, float]:
    start = time.perf_counter()
    result = work()
    return result, time.perf_counter() - start


def in_thread(work: Callable[[], Any]) -> Any:
    """``work()`` in a new thread, its result (or its exception) back."""
    outcome: Dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = work()
        except BaseException as error:  # handed to the caller below
            outcome["error"] = error

    thread = threading.Thread(target=run, name="attention-setup")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def measure(providers: List[Any], packed: bool = True) -> List[Dict[str, Any]]:
    """The four runs of every shape (see the module's text), in seconds; ``packed``: as for :func:`attention_model`."""
    import onnxruntime as ort

    def made_and_run(model: bytes) -> Tuple[float, float, Callable[[], Any]]:
        """The session's creation and first run, in seconds, and its next run (the same feed)."""
        session, made_s = timed(lambda: ort.InferenceSession(model, providers=providers))
        feed = feed_of(session)
        _, run_s = timed(lambda: session.run(None, feed))
        return made_s, run_s, lambda: session.run(None, feed)

    rows = []
    for tokens, head_size in SHAPES:
        for kind in ("self", "cross"):
            model = attention_model(kind, tokens, head_size, packed)
            made_s, first_s, run_again = made_and_run(model)
            _, again_s = timed(run_again)
            thread_made_s, thread_s, _ = in_thread(lambda: made_and_run(model))
            session_made_s, session_s, _ = made_and_run(model)
            rows.append(
                {
                    "kind": kind,
                    "tokens": tokens,
                    "head_size": head_size,
                    "first_s": first_s,
                    "again_s": again_s,
                    "thread_s": thread_s,
                    "session_s": session_s,
                    "made_s": [made_s, thread_made_s, session_made_s],
                }
            )
            print(
                f"{kind:5} {tokens:5} × {head_size:3}: first {first_s * 1000:8.1f} ms  again {again_s * 1000:7.1f}  "
                f"thread {thread_s * 1000:8.1f}  session {session_s * 1000:8.1f}",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for attention-setup.json")
    parser.add_argument(
        "--sdpa-kernel", help="ORT's sdpa_kernel provider option (1 flash, 8 cuDNN's, …); ORT's own choice if not given"
    )
    parser.add_argument("--provider", choices=("cuda", "cpu"), default="cuda", help="cpu: checks the script only")
    args = parser.parse_args()
    import onnxruntime as ort

    if args.provider == "cuda":
        options = {"cudnn_conv_algo_search": "HEURISTIC"}
        if args.sdpa_kernel is not None:
            options["sdpa_kernel"] = args.sdpa_kernel
        providers: List[Any] = [("CUDAExecutionProvider", options)]
    else:
        providers = ["CPUExecutionProvider"]
    rows = measure(providers, packed=args.provider == "cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "onnxruntime": ort.__version__,
        "provider": args.provider,
        "sdpa_kernel": args.sdpa_kernel,
        "batch": BATCH,
        "heads": HEADS,
        "rows": rows,
    }
    (args.out / "attention-setup.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
