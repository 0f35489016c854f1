"""CUDA-graph replay of fixed-shape window forwards (gpt-fast style): one capture per input shape,
inputs copied into static tensors, outputs read from the captured ones. Off on CPU. ``StepShapes``: the distinct
shapes a run's cached steps take (what a graph per shape would capture)."""
from __future__ import annotations

from collections import Counter
from typing import Callable

import torch


class GraphRunner:
    """Call ``fn(*tensors)`` eagerly, or through a CUDA graph captured per input shape signature.

    ``fn`` must only read its inputs and tensors that outlive the runner (weights, static buffers),
    and must be idempotent for equal inputs (the capture warm-up executes it once)."""

    def __init__(self, fn: Callable, enabled: bool):
        self.fn, self.enabled, self.graphs = fn, enabled, {}
        self.pool = torch.cuda.graph_pool_handle() if enabled else None

    def __call__(self, *args: torch.Tensor):
        if not self.enabled:
            return self.fn(*args)
        key = tuple((a.shape, a.dtype) for a in args)
        if key not in self.graphs:
            self.graphs[key] = self._capture(args)
        graph, static_in, out = self.graphs[key]
        for s, a in zip(static_in, args):
            s.copy_(a)
        graph.replay()
        return out

    def _capture(self, args):
        static_in = [a.clone() for a in args]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.fn(*static_in)  # warm-up: lazy kernel/workspace init outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.fn(*static_in)
        return graph, static_in, out


class StepShapes:
    """Within ``with StepShapes() as shapes``: how often each shape of a cached step ran (``seen``), by what
    ``note`` is told: ``("layer", N, n)`` a cached layer over N rows recomputing n (the bucket), ``("attention", m,
    q, T)`` packed attention of m requests, q query rows each, over T keys. One recorder at a time (a test's)."""

    active: "StepShapes | None" = None

    def __init__(self):
        self.seen: Counter = Counter()

    def __enter__(self) -> "StepShapes":
        StepShapes.active = self
        return self

    def __exit__(self, *exc) -> None:
        StepShapes.active = None


def note(*shape) -> None:
    """Count ``shape`` in the active ``StepShapes`` (none: nothing)."""
    if StepShapes.active is not None:
        StepShapes.active.seen[shape] += 1
