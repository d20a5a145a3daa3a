"""Load test of a running ``/v1/images`` service: images/s and latency percentiles at one or more concurrencies.

Each concurrency level runs that many client threads in a closed loop (each sends its next request once its last
one is answered) until ``warmup`` uncounted answers and then ``requests`` counted ones came, without draining in
between (see :func:`run_level`). A level's row gives images/s over the counted answers' time, p50/p95/p99 latency of
the answered requests, the status codes, the errors by their kind (the status of an answer other than 200, or the
kind of exception of a request without an answer) with their messages, and the batch sizes the service reported
(``X-Batch-Images``). While a level runs, :class:`LevelProgress` shows its answers and errors so far on stderr: a line
rewritten in place on a terminal, one plain line per level where stderr is a log. Writes ``loadtest.json`` (with the command, URL and date), ``loadtest.md`` and,
where matplotlib is installed (the ``plot`` extra: ``pip install 'optimum-iobinding[plot]'``), ``loadtest.png``.

    optimum-iobinding loadtest http://127.0.0.1:8000 --concurrency 1,4,16,64 --requests 128 --out results/
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import statistics
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, Dict, List, Optional, Sequence, Tuple, Union

logger = logging.getLogger(__name__)

# the service's seeds (serve.schema.MAX_SEED; not imported from there: the load test runs without the serve extra)
MAX_SEED = 2**63 - 1


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The ``q``-th percentile (0–100), numpy's linear interpolation between closest ranks; ``None`` for no values."""
    import numpy as np

    return float(np.percentile(values, q)) if values else None


# the service's own account of a request's time (seconds), nested: the pipeline call that made its image ⊂ its time
# waiting for and riding in a batch ⊂ its time in the replica's HTTP handler, which besides holds the read of its body
# (from Serve's proxy), its checks and its PNGs' encoding (in the batch's time for stored PNGs); the client's latency
# adds HTTP and Serve's proxy
SERVER_TIMES = {
    "pipeline_s": "X-Pipeline-Seconds",
    "replica_s": "X-Replica-Seconds",
    "server_s": "X-Server-Seconds",
    "body_s": "X-Body-Seconds",
    "encode_s": "X-Encode-Seconds",
}


def one_request(url: str, body: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(
        url.rstrip("/") + "/v1/images", data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
            status, headers = response.status, response.headers
    except urllib.error.HTTPError as error:
        status, headers, refusal = error.code, error.headers, answer_reason(error.code, error.read())
    except (OSError, http.client.HTTPException) as error:  # no HTTP answer: refused, reset, timed out, not HTTP
        return {
            "status": None,
            "error": failure_reason(error),
            "error_kind": failure_kind(error),
            "seconds": time.perf_counter() - start,
        }
    seconds = time.perf_counter() - start
    batch = headers.get("X-Batch-Images")
    result = {"status": status, "seconds": seconds, "batch_images": int(batch) if batch else None}
    if status != 200:
        result.update(error=refusal if status >= 400 else str(status), error_kind=str(status))
    for key, header in SERVER_TIMES.items():
        value = headers.get(header)
        result[key] = float(value) if value else None
    return result


def answer_reason(status: int, content: bytes) -> str:
    """An answer's error in one line: its status and the message the service gave (FastAPI's ``detail``, OpenAI's
    ``error.message``), if any."""
    try:
        body = json.loads(content)
    except ValueError:
        return str(status)
    message = body.get("detail") if isinstance(body, dict) else None
    if isinstance(message, list) and message and isinstance(message[0], dict):  # a malformed body's (422)
        first = message[0]
        message = f"{'.'.join(str(part) for part in first.get('loc', ())[1:])}: {first.get('msg', '')}"
    if message is None and isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = body["error"].get("message")
    if not isinstance(message, str) or not message.strip():
        return str(status)
    line = message.strip().splitlines()[0]
    return f"{status}: {line if len(line) <= 200 else line[:199] + '…'}"


def failure_kind(error: BaseException) -> str:
    """The kind of a request's failure to get an HTTP answer: the exception behind it (``ConnectionRefusedError``,
    ``TimeoutError``, ``RemoteDisconnected``), not urllib's wrapper."""
    reason = error.reason if isinstance(error, urllib.error.URLError) else error
    return type(reason).__name__ if isinstance(reason, BaseException) else type(error).__name__


def error_counts(kinds: Sequence[Optional[str]]) -> Dict[str, int]:
    """How many errors of each kind, the most frequent first."""
    return dict(Counter(kind or "error" for kind in kinds).most_common())


def errors_text(counts: Dict[str, int]) -> str:
    """``"400 ×2, ConnectionRefusedError ×1"``: each kind and its count."""
    return ", ".join(f"{kind} ×{count}" for kind, count in counts.items())


def failure_reason(error: BaseException) -> str:
    """Why a request got no HTTP answer, in a few words: ``Connection refused``, not ``<urlopen error [Errno 111]
    Connection refused>``."""
    reason = error.reason if isinstance(error, urllib.error.URLError) else error
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return str(reason) or type(reason).__name__


class LevelProgress:
    """What one level has done so far, shown on ``stream`` while it runs: the answers that came of the level's
    ``warmup + requests``, the errors among them by kind (answers other than 200 by status, and requests that got no
    HTTP answer by exception: ``2 errors (503 ×1, ConnectionResetError ×1)``) and the images/s of the counted answers
    since the warm-up ended.

    Where ``stream`` is a terminal (``isatty()``) the line is tqdm's, rewritten in place at most every
    ``refresh_seconds``; elsewhere (a log, CI) nothing shows while the level runs and one plain line is written when
    it ends (:meth:`close`), so that a log gets a line per level rather than a stream of carriage returns.

    Args:
        concurrency: the level's client threads (named on the line).
        requests: the level's counted requests.
        warmup: the uncounted answers first.
        images_per_request: images a request that succeeds makes (the request body's ``n``).
        stream: where the line goes (the command's: ``sys.stderr``).
        start: when the level started (``time.perf_counter()``): the start of its images/s without warm-up.
        refresh_seconds: on a terminal, the least time between two redraws.
    """

    def __init__(
        self,
        concurrency: int,
        requests: int,
        warmup: int,
        images_per_request: int,
        stream: IO[str],
        start: Optional[float] = None,
        refresh_seconds: float = 0.1,
    ):
        self.concurrency = concurrency
        self.total = warmup + requests
        self.warmup = warmup
        self.images_per_request = images_per_request
        self.stream = stream
        self.answered = 0
        self.errors = 0
        self.error_kinds: List[Optional[str]] = []
        self.images = 0
        self.window_start = (time.perf_counter() if start is None else start) if warmup == 0 else None
        self.bar: Any = None
        if is_terminal(stream):
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.total,
                desc=f"concurrency {concurrency}",
                file=stream,
                unit="request",
                bar_format="{desc}: {n_fmt}/{total_fmt} requests |{bar}| {postfix} [{elapsed}]",
                postfix=self.counts(None),
                mininterval=refresh_seconds,
                miniters=1,
                leave=True,
            )

    def counts(self, images_per_s: Optional[float]) -> str:
        """``"2 errors (400 ×2), 3.10 images/s"`` (``—`` images/s until a counted answer came)."""
        rate = "—" if images_per_s is None else f"{images_per_s:.2f}"
        kinds = f" ({errors_text(error_counts(self.error_kinds))})" if self.errors else ""
        return f"{self.errors} error{'' if self.errors == 1 else 's'}{kinds}, {rate} images/s"

    def images_per_s(self, now: float) -> Optional[float]:
        """Images/s of the counted answers so far, since the warm-up ended; ``None`` before any counted answer."""
        if self.window_start is None or self.answered <= self.warmup or now <= self.window_start:
            return None
        return self.images / (now - self.window_start)

    def add(self, ok: bool, when: float, kind: Optional[str] = None) -> None:
        """One answer came at ``when`` (``time.perf_counter()``); ``ok``: status 200; otherwise ``kind`` says what
        failed (the status, or the exception of a request without an answer)."""
        self.answered += 1
        self.errors += not ok
        if not ok:
            self.error_kinds.append(kind)
        if self.answered == self.warmup:
            self.window_start = when
        elif self.answered > self.warmup and ok:
            self.images += self.images_per_request
        if self.bar is not None:
            self.bar.set_postfix_str(self.counts(self.images_per_s(when)), refresh=False)
            self.bar.update()

    def close(self, row: Dict[str, Any]) -> None:
        """The level ended with ``row`` (:func:`run_level`'s): its images/s replace the running figure. Where no
        request got an HTTP answer the line is dropped (the command then says why in one line of its own)."""
        if self.bar is not None:
            if unanswered(row):
                self.bar.leave = False
            else:
                self.bar.set_postfix_str(self.counts(row["images_per_s"]), refresh=False)
            self.bar.close()
        elif not unanswered(row):
            print(
                f"concurrency {self.concurrency}: {self.answered}/{self.total} requests, "
                f"{self.counts(row['images_per_s'])}",
                file=self.stream,
                flush=True,
            )


def is_terminal(stream: IO[str]) -> bool:
    """Whether ``stream`` is a terminal (a closed or detached stream is not)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def run_level(
    url: str,
    concurrency: int,
    requests: int,
    body: Dict[str, Any],
    warmup: int = 0,
    timeout: float = 600.0,
    progress: Optional[IO[str]] = None,
) -> Dict[str, Any]:
    """One concurrency level, a closed loop at steady state: ``concurrency`` clients each send their next request
    when their last one is answered, without pause, until ``warmup + requests`` answers came. The first ``warmup``
    answers are not counted; the level's row covers answers ``warmup + 1`` … ``warmup + requests``, and its time runs
    from the ``warmup``-th answer (the start, without warm-up) to the last counted one. The clients never drain in
    between, so a batching service is timed at the concurrency asked for; answers to the requests still out at
    the end are awaited and not counted. ``progress``: a stream to show the level's progress on
    (:class:`LevelProgress`), ``None`` for none."""
    if concurrency < 1 or requests < 1 or warmup < 0:
        raise ValueError(
            f"concurrency and requests: expected positive integers and warmup ≥ 0, got {concurrency}, "
            f"{requests} and {warmup}"
        )
    total = warmup + requests
    lock = threading.Lock()
    state = {"sent": 0, "answers": []}  # answers in the order they came, each with the time it came
    start = time.perf_counter()
    shown = (
        None
        if progress is None
        else LevelProgress(concurrency, requests, warmup, int(body.get("n", 1)), progress, start)
    )

    def client() -> None:
        while True:
            with lock:
                if len(state["answers"]) >= total:  # still sending until then: the load never drops in the window
                    return
                index = state["sent"]
                state["sent"] += 1
            result = one_request(url, dict(body, seed=int(body.get("seed", 0)) + index), timeout)
            with lock:
                result["answered"] = time.perf_counter()
                state["answers"].append(result)
                if shown is not None and len(state["answers"]) <= total:  # not those still out at the end
                    shown.add(result["status"] == 200, result["answered"], result.get("error_kind"))

    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(client) for _ in range(concurrency)]:
            future.result()
    answers = sorted(state["answers"], key=lambda r: r["answered"])
    window_start = answers[warmup - 1]["answered"] if warmup else start
    results = answers[warmup:total]
    wall = results[-1]["answered"] - window_start
    ok = [r for r in results if r["status"] == 200]
    latencies = [r["seconds"] for r in ok]
    images = len(ok) * int(body.get("n", 1))
    row = {
        "concurrency": concurrency,
        "requests": requests,
        "warmup": warmup,
        "ok": len(ok),
        "wall_s": wall,
        "images_per_s": images / wall if wall > 0 else None,
        "p50_s": percentile(latencies, 50),
        "p95_s": percentile(latencies, 95),
        "p99_s": percentile(latencies, 99),
        "mean_s": statistics.fmean(latencies) if latencies else None,
        # means of the service's own times (SERVER_TIMES): where the latency went
        **{
            key.replace("_s", "_mean_s"): statistics.fmean(values)
            if (values := [r[key] for r in ok if r.get(key)])
            else None
            for key in SERVER_TIMES
        },
        "statuses": dict(Counter(str(r["status"]) for r in results)),
        "batch_images": dict(sorted(Counter(r.get("batch_images") for r in ok if r.get("batch_images")).items())),
        # the errors by kind (the status, or the exception of a request without an answer), and a few of their
        # messages
        "error_counts": error_counts([r["error_kind"] for r in results if "error_kind" in r]),
        "errors": sorted({r["error"] for r in results if "error" in r})[:5],
    }
    if shown is not None:
        shown.close(row)
    return row


def run_loadtest(
    url: str,
    concurrency: Sequence[int],
    requests: int,
    body: Dict[str, Any],
    warmup: int = -1,
    timeout: float = 600.0,
    progress: Optional[IO[str]] = None,
) -> List[Dict[str, Any]]:
    """Every level in turn; ``warmup=-1`` sends one uncounted request per client thread first; ``progress`` as
    :func:`run_level` takes it."""
    return [
        run_level(url, level, requests, body, level if warmup < 0 else warmup, timeout, progress)
        for level in concurrency
    ]


def table(rows: Sequence[Dict[str, Any]]) -> str:
    def ms(value: Optional[float]) -> str:
        return "" if value is None else f"{value * 1000:.0f}"

    lines = [
        "| concurrency | requests (ok) | images/s | p50 ms | p95 ms | p99 ms | batch images seen | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        batches = ", ".join(f"{size}×{count}" for size, count in row["batch_images"].items())
        rate = "" if row["images_per_s"] is None else f"{row['images_per_s']:.2f}"
        lines.append(
            f"| {row['concurrency']} | {row['requests']} ({row['ok']}) | {rate} | {ms(row['p50_s'])} | "
            f"{ms(row['p95_s'])} | {ms(row['p99_s'])} | {batches} | {errors_text(row.get('error_counts', {}))} |"
        )
    return "\n".join(lines + error_lines(rows))


def error_lines(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """Below the table, a line per level with errors: what they said (a few of their messages)."""
    lines = [f"- concurrency {row['concurrency']}: " + "; ".join(row["errors"]) for row in rows if row.get("errors")]
    return ["", "Errors:", *lines] if lines else []


PLOT_EXTRA = "pip install 'optimum-iobinding[plot]'"


def write_results(out: Path, rows: Sequence[Dict[str, Any]], meta: Dict[str, Any]) -> List[Path]:
    """``loadtest.json`` and ``loadtest.md`` into ``out``, and ``loadtest.png`` where matplotlib is installed (where
    it is not, one warning says so and names the extra that installs it). Returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "loadtest.json", out / "loadtest.md"]
    written[0].write_text(json.dumps({**meta, "rows": list(rows)}, indent=2))
    written[1].write_text(f"# Load test: {meta['url']}\n\n`{meta['command']}` — {meta['date']}\n\n{table(rows)}\n")
    plot = write_plot(out / "loadtest.png", rows, meta["url"])
    return written + ([plot] if plot else [])


def write_plot(path: Path, rows: Sequence[Dict[str, Any]], title: str) -> Optional[Path]:
    """images/s and p50/p99 latency against concurrency; ``None`` (and a warning) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("%s not drawn: matplotlib is not installed (%s)", path.name, PLOT_EXTRA)
        return None
    levels = [row["concurrency"] for row in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(levels, [row["images_per_s"] or 0 for row in rows], marker="o")
    left.set_xscale("log", base=2)
    left.set_xlabel("concurrency")
    left.set_ylabel("images/s")
    for key, label in (("p50_s", "p50"), ("p99_s", "p99")):
        right.plot(levels, [(row[key] or 0) * 1000 for row in rows], marker="o", label=label)
    right.set_xscale("log", base=2)
    right.set_xlabel("concurrency")
    right.set_ylabel("latency ms")
    right.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


# ------------------------------------------------------------------------------------------------ the command
def positive_integers(option: str, text: str) -> List[int]:
    """``"1,4,16"`` → ``[1, 4, 16]``."""
    try:
        values = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{option}: expected positive integers, comma-separated like 1,4,16, got {text!r}")
    return values


def request_size(text: str) -> Union[int, str]:
    """``--size`` as the service's ``size`` takes it: ``512`` (an int: a square) or ``"768x512"`` (width x height)."""
    parts = text.lower().split("x")
    if len(parts) in (1, 2) and all(part.strip().isdecimal() and int(part) > 0 for part in parts):
        return int(parts[0]) if len(parts) == 1 else f"{int(parts[0])}x{int(parts[1])}"
    raise ValueError(f"--size: expected pixels as 512 or 768x512 (width x height), got {text!r}")


def check_url(url: str) -> str:
    """The service's address, ``http(s)://host[:port]``."""
    try:
        parts = urllib.parse.urlsplit(url)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is no number, or out of range
        valid = False
    if not valid:
        raise ValueError(f"url: expected the service's address, like http://127.0.0.1:8000, got {url!r}")
    return url


def check_arguments(args: Any) -> Tuple[List[int], Dict[str, Any]]:
    """Every option, checked before the first request and named in its error; returns the concurrency levels and
    the request body."""

    def check(ok: bool, option: str, expected: str, value: Any) -> None:
        if not ok:
            raise ValueError(f"{option}: expected {expected}, got {value!r}")

    check_url(args.url)
    levels = positive_integers("--concurrency", args.concurrency)
    check(args.requests >= 1, "--requests", "a positive integer", args.requests)
    check(args.warmup >= -1, "--warmup", "a count ≥ 0, or -1 for one per client thread", args.warmup)
    check(0 <= args.seed <= MAX_SEED, "--seed", f"an integer in 0 … {MAX_SEED} (the service's seeds)", args.seed)
    check(args.steps is None or args.steps >= 1, "--steps", "a positive integer", args.steps)
    check(args.guidance is None or math.isfinite(args.guidance), "--guidance", "a finite number", args.guidance)
    check(math.isfinite(args.timeout) and args.timeout > 0, "--timeout", "seconds > 0", args.timeout)
    check(
        not args.out or not Path(args.out).exists() or Path(args.out).is_dir(),
        "--out",
        "a folder, not a file",
        args.out,
    )
    body: Dict[str, Any] = {"prompt": args.prompt, "seed": args.seed, "response_format": "png"}
    for key, value in (("steps", args.steps), ("guidance", args.guidance)):
        if value is not None:
            body[key] = value
    if args.size is not None:
        body["size"] = request_size(args.size)
    return levels, body


def unanswered(row: Dict[str, Any]) -> bool:
    """Whether no request of a level got an HTTP answer (none reached a service)."""
    return set(row["statuses"]) == {"None"}


def main_from_args(args: Any) -> int:
    """The ``optimum-iobinding loadtest`` command. Levels run in turn, each showing its progress on stderr
    (:class:`LevelProgress`); where no request of a level got an HTTP
    answer, the next ones would not either: the command stops and says why in one line (exit status 1), after
    writing the rows of the levels before."""
    levels, body = check_arguments(args)
    rows: List[Dict[str, Any]] = []
    for level in levels:
        rows.append(
            run_level(
                args.url,
                level,
                args.requests,
                body,
                level if args.warmup < 0 else args.warmup,
                args.timeout,
                progress=sys.stderr,
            )
        )
        if unanswered(rows[-1]):
            break
    answered_levels = rows[:-1] if unanswered(rows[-1]) else rows
    if answered_levels:
        print(table(rows))
        if args.out:
            meta = {
                "url": args.url,
                "command": " ".join(["optimum-iobinding", *sys.argv[1:]]),
                "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                "body": body,
            }
            for path in write_results(Path(args.out), rows, meta):
                print(path)
    if unanswered(rows[-1]):
        reason = rows[-1]["errors"][0] if rows[-1]["errors"] else "no answer"
        raise ConnectionError(f"url: no service answered at {args.url}: {reason} (is the server running?)")
    return 0 if all(row["ok"] == row["requests"] for row in rows) else 1
