"""What a pipeline's parts (its denoiser, prompt encoder, latent codec) share: the pipeline they belong to, held
weakly."""

from __future__ import annotations

import weakref
from typing import Any


class PipelinePart:
    """A part of a pipeline that reads the pipeline it belongs to (its components, device, scheduler).

    The pipeline holds its parts and a part holds the pipeline weakly: a dropped pipeline is freed with its last
    reference, its sessions (their device memory) at once, not at the garbage collector's next cycle, wherever that
    comes (a session freed on CUDA synchronizes the device)."""

    def __init__(self, pipe: Any):
        self._pipe = weakref.ref(pipe)

    @property
    def pipe(self) -> Any:
        """The pipeline this part belongs to."""
        pipe = self._pipe()
        if pipe is None:
            raise ReferenceError(f"{type(self).__name__}: the pipeline it belongs to is gone")
        return pipe
