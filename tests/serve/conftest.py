"""The fixtures the serving tests share (Ray is imported where a test uses it: the optimum environment has none)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def flood_statuses():
    """``flood_statuses(folder, url, name, requests, steps, size, post)``: the HTTP statuses of ``requests`` requests
    sent at once to a CPU deployment ``name`` of ``folder`` on the running Serve at ``url``, which holds one request in
    its replica and queues one more (``max_ongoing_requests`` = ``max_queued_requests`` = 1); ``post(url, body)``
    answers a tuple whose first item is the status. The deployment is deleted afterwards."""

    def flood(folder, url: str, name: str, requests: int, steps: int, size: int, post) -> list:
        from concurrent.futures import ThreadPoolExecutor

        from ray import serve

        from optimum_iobinding.serve import ServeConfig, build_app

        config = ServeConfig(
            model=str(folder),
            device="cpu",
            max_batch_size=1,
            steps=steps,
            warmup_batch_sizes=[],
            max_ongoing_requests=1,
            max_queued_requests=1,
        )
        serve.run(build_app(config), name=name, route_prefix=f"/{name}", blocking=False)
        try:
            bodies = [dict(prompt="busy", seed=i, size=size) for i in range(requests)]
            with ThreadPoolExecutor(len(bodies)) as pool:
                return [answer[0] for answer in pool.map(lambda body: post(f"{url}/{name}", body), bodies)]
        finally:
            serve.delete(name)

    return flood
