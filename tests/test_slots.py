"""The core's request lifecycle on a paged host (``dllm_core.engine.slots.ResponseSlots``): one batched step
reads the device at most once, and its loop is the embedded engine's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dllm_core.cache import HostRequest, make_cache
from dllm_core.engine.logprobs import Logprobs
from dllm_core.engine.request import DecodeOptions
from dllm_core.engine.slots import ResponseSlots, SlotConfig
from dllm_core.engine.step import SlotStates, denoise_step
from dllm_core.sampling import TokenContext

MASK, V, W = 99, 100, 16
READS = {"tolist", "item", "__bool__", "numpy", "cpu", "__int__", "__float__", "__index__", "__array__"}


class OnDevice(torch.Tensor):
    """A CPU tensor standing for device memory: every read of it into host values is counted."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            OnDevice.reads.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


SPECS = [("threshold:tau=0.5", None, 8), ("low_confidence", 8, 8), ("slowfast:k=2", None, 8),
         ("threshold:tau=0.5", None, 4)]


def configs():
    out = []
    for sampler, steps, block in SPECS:
        opts = DecodeOptions(sampler=sampler, steps=steps, block_length=block)
        out.append(SlotConfig.of(opts, opts.response(W)))
    return out


def run(device_tensors: bool, seed: int = 0):
    """Every request of ``SPECS`` (one slot each, slot 2k + 1) decoded by the core's loop, all stepping at once
    under Fast-dLLM's dual cache; -> (canvases [n, W], device reads of each plan and take)."""
    g = torch.Generator().manual_seed(seed)
    slots = ResponseSlots(2 * len(SPECS), W, MASK, "cpu")
    s = np.arange(len(SPECS)) * 2 + 1
    for i, (slot, c) in enumerate(zip(s.tolist(), configs())):  # the first two ask for logprobs (no read either)
        slots.admit(slot, c, HostRequest(make_cache("dual"), 5), logprobs=2 if i < 2 else None)
    if device_tensors:
        slots.canvas = slots.canvas.as_subclass(OnDevice)
        for ss in slots.states.values():
            ss.full = {k: v.as_subclass(OnDevice) if isinstance(v, torch.Tensor) else v for k, v in ss.full.items()}
    prefix = np.full(len(s), 5)
    slots.start(s, prefix, np.full(len(s), W))
    reads, live = [], s
    while len(live):
        logits = torch.randn(len(live), 8, V, generator=g)
        lg = [logits[i, :slots.config[x].block_length] for i, x in enumerate(live.tolist())]
        OnDevice.reads = []
        slots.begin(live)
        plans = slots.plan(live, prefix[:len(live)], np.full(len(live), W), 0)
        reads.append(("plan", len(OnDevice.reads)))
        done = np.zeros(len(live), dtype=bool)
        for L in sorted({x.shape[0] for x in lg}):  # one take per block length (as vLLM's sampler does)
            rows = np.array([i for i, x in enumerate(lg) if x.shape[0] == L])
            t = torch.stack([lg[i] for i in rows])
            OnDevice.reads = []
            done[rows] = slots.take(live[rows], t.as_subclass(OnDevice) if device_tensors else t)
            reads.append(("take", len(OnDevice.reads)))
        assert all(p.run_from <= 5 for p in plans)
        live = live[~done]
    return slots.canvas[s].as_subclass(torch.Tensor), reads


def test_one_batched_step_reads_the_device_once():
    """Four requests under three samplers (one that moves its window) and two block lengths: each ``take`` of the
    batch reads the device once (its groups' ``done`` and the next focus in one transfer), ``begin`` and ``plan``
    never."""
    canvas, reads = run(device_tensors=True)
    assert len(reads) > 8 and {n for what, n in reads if what == "plan"} == {0}, reads
    assert {n for what, n in reads if what == "take"} == {1}, reads
    assert not (canvas == MASK).any()
    plain, _ = run(device_tensors=False)
    assert torch.equal(canvas, plain)


def test_the_loop_is_the_embedded_one():
    """Each slot's canvas equals the embedded loop body run alone on its block (same logits, same sampler)."""
    g = torch.Generator().manual_seed(3)
    c = configs()[2]  # slowfast: the focus read back from the device drives the next step's window
    slots = ResponseSlots(1, W, MASK, "cpu")
    slots.admit(0, c, HostRequest(make_cache("dual"), 0), logprobs=3)
    s = np.array([0])
    slots.start(s, np.array([0]), np.array([W]))
    ref, ref_lp = torch.full((1, W), MASK), Logprobs.empty(1, W, 3, "cpu")  # and the embedded loop's logprobs
    ss = SlotStates(c.sampler, c.block_length, c.steps, "cpu", 1)
    tc = TokenContext(MASK)
    for b in range(W // c.block_length):
        cols = slice(b * c.block_length, (b + 1) * c.block_length)
        ss.reset(torch.tensor([0]), ref[:, cols] == MASK)
        st = ss.gather(torch.tensor([0]))
        while (ref[:, cols] == MASK).any():
            logits = torch.randn(1, c.block_length, V, generator=g)
            slots.begin(s)
            slots.plan(s, np.array([0]), np.array([W]), 0)
            slots.take(s, logits)
            new, _ = denoise_step(c.sampler, st, logits, ref[:, cols], tc)
            ref_lp.record(logits, ref[:, cols], new, cols.start)
            ref[:, cols] = new
            assert torch.equal(slots.canvas, ref)
    assert not (ref == MASK).any()
    got = slots.logprobs_of(0, slice(None))
    assert torch.equal(got.token, ref_lp.token[0]) and torch.equal(got.top_ids, ref_lp.top_ids[0])
    assert torch.equal(got.top, ref_lp.top[0]) and (got.token < 0).all()


def test_release_keeps_the_work_by_request_id():
    slots = ResponseSlots(2, W, MASK, "cpu", layers=3)
    slots.admit(1, configs()[0], HostRequest(make_cache("dual"), 5), rid="a")
    slots.count(np.array([1]), np.array([21 * 3]))
    slots.token_layers[1] += 7
    assert slots.work("a") == {"forwards": 1, "token_layers": 7, "full_token_layers": 63}
    slots.release(1)
    assert slots.config[1] is None and slots.work("a") == slots.finished_work["a"]
    assert slots.work("b") is None
    with pytest.raises(KeyError):
        slots.finished_work["b"]
