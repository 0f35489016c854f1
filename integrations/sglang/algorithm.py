"""dllm_core samplers as SGLang dLLM algorithms (``--dllm-algorithm SlowFast`` ...): ``prepare_inputs`` before and
``step`` after every forward of a block go to a host on the core's ``ResponseSlots``: ``BlockHost`` (SGLang's block
canvas; a row is done once a forward has seen its block final, so it persists its K/V) or ``ResponseHost``.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any, ClassVar, List

import numpy as np
import torch

from dllm_core.engine.block_canvas import BlockLifecycle
from dllm_core.engine.host_options import FlatOptions
from dllm_core.engine.step import mask_in_prompt
from dllm_core.options import OptionError

from sglang.srt.dllm.algorithm.base import DllmAlgorithm
from sglang.srt.dllm.config import DllmConfig

from .response import ResponseHost, SlotsHost
from .options import logprobs, parse, read_yaml, request, with_default_cache

logger = logging.getLogger(__name__)


class DllmServeConfig(DllmConfig):
    """SGLang's ``DllmConfig`` for the dllm-serve models + dllm_core's prompt rule and response rule at admission
    (the scheduler answers a returned error with HTTP 400): no mask token in a prompt, ``max_new_tokens`` >= 1
    (decoded in whole blocks) and a ``steps`` total that splits evenly over them."""

    def validate_request(self, req) -> str | None:
        return (mask_in_prompt(req.origin_input_ids, self.mask_id) or self.response_error(req)
                or super().validate_request(req))

    def response_error(self, req) -> str | None:
        """The request's own options (``custom_params.dllm``, its sampling parameters) and its response."""
        opts, sp = self.options(), getattr(req, "sampling_params", None)
        try:
            if opts is not None and sp is not None:
                request(opts, req, self.block_size).response(sp.max_new_tokens or 0, self.block_size)
        except (OptionError, ValueError) as e:
            return f"{self.algorithm}: {e}"
        return None

    def options(self):
        """The algorithm's parsed options (None: not one of ours)."""
        if not hasattr(self, "_opts"):
            from sglang.srt.dllm.algorithm import get_algorithm_cls

            cls = get_algorithm_cls(self.algorithm)
            self._opts = cls.options(self.algorithm_config or {}) if hasattr(cls, "options") else None
        return self._opts


class DllmCoreAlgorithm(DllmAlgorithm):
    """Base adapter; subclasses name the dllm_core sampler (``sampler_name``)."""

    sampler_name: ClassVar[str | None] = None

    @classmethod
    def options(cls, cfg: dict) -> FlatOptions:
        return parse(cls.__name__, cls.sampler_name, cfg)

    @classmethod
    def configure_server_args(cls, server_args) -> None:
        """Launch-time: validate the YAML (fail before any worker starts); a cache with data-dependent rows needs a
        dllm-serve model, and a policy over the whole response turns the radix cache off (a refresh rewrites the
        prefix K/V in place). CUDA graphs stay on: a forward whose ``StepContext`` runs cached layers or packed rows
        runs eager (``plain_forwards_only``), every other forward replays SGLang's graphs."""
        from sglang.srt.arg_groups.overrides import resolving_view

        from .plugin import ARCHS, model_architecture

        cfg = resolving_view(server_args)
        path, arch = cfg.dllm_algorithm_config, model_architecture(server_args)
        try:  # our model classes default to a policy over the whole response
            opts = cls.options(with_default_cache(read_yaml(path), arch in ARCHS))
        except ValueError as e:
            raise ValueError(f"--dllm-algorithm-config {path}: {e}") from None
        pol = opts.policy or (opts.cache if opts.caching else None)  # a cache with data-dependent rows
        if pol is None:
            return
        where = f"--dllm-algorithm-config {path}: {cls.__name__}.cache: {pol.name}"
        if arch not in ARCHS:
            raise ValueError(f"{where} needs one of the dllm-serve models {list(ARCHS)}, got {arch}")
        if opts.policy is not None:
            disable_radix_cache(server_args, f"{cls.__name__}: cache {pol.name} rewrites each request's prefix K/V "
                                             f"in place")

    def __init__(self, config: DllmConfig):
        super().__init__(config)
        self.opts = self.options(config.algorithm_config or {})
        self.sampler = self.opts.sampler
        self.steps = self.opts.decode.steps or self.block_size  # the most steps a block can take
        host = ResponseHost if self.opts.policy is not None else BlockHost
        self.host = host(self.opts.policy or self.opts.cache, self.opts, self.block_size, self.mask_id)
        self.whole = self.host if host is ResponseHost else None

    def max_steps(self, block_size: int) -> int:
        """Forwards per block in the synchronous loop: the sampler's most + the one persisting the block (a policy
        over the whole response: a block of SGLang's may span two of the canvas)."""
        return self.sampler.max_steps(block_size, self.steps) * (2 if self.whole else 1) + 1

    def init_step_state(self, forward_batch) -> List[Any]:
        """Per request, its SGLang block in flight: whether its canvas starts at the next forward (``fresh``) and
        whether it is decoded, so that forward persists it (``final``); the rest is the core's (``ResponseSlots``)."""
        return [SimpleNamespace(fresh=True, final=False) for _ in range(forward_batch.batch_size)]

    def prepare_inputs(self, model_runner, forward_batch, states: List[Any]) -> None:
        self.host.prepare(model_runner, forward_batch, states)

    def step(self, forward_batch, full_logits: torch.Tensor, states: List[Any]) -> List[bool]:
        return self.host.step(forward_batch, full_logits, states)


class BlockHost(SlotsHost):
    """SGLang's block canvas on the core's ``BlockLifecycle`` (``lc``): each SGLang block is a canvas of one block of
    the request's slot (its sampler rows and policy state kept across blocks and rounds; dLLM-Cache over the block:
    its features)."""

    prompt_only = False  # the batch's blocks hold no mask: nothing to decode
    fb: tuple | None = None  # the batch in flight and its pool indices (its slots: ``slots``)

    def new_lifecycle(self, model, device) -> BlockLifecycle:
        ours = hasattr(model, "context")  # a dllm-serve model (SGLang's own LLaDA2 class: exact, no features)
        shape = (len(model.layers), model.layers[0].kv_size, model.args.dim, model.embed.weight) if ours else None
        return BlockLifecycle(self.L, self.mask_id, device, self.opts.decode.seed, shape or (0, 0, 0, None))

    def admit(self, slot: int, gen: int, req, model, device) -> None:
        """A new request with its own options."""
        self.lc.admit(slot, getattr(req, "rid", None) or f"slot{slot}.gen{gen}", request(self.opts, req, self.L),
                      req.sampling_params.max_new_tokens, len(req.origin_input_ids), req.sampling_params.sampling_seed,
                      logprobs(req))

    def prepare(self, model_runner, fb, states: list) -> None:
        """Before each forward: new requests admitted and fresh blocks started (SGLang's block ids, literal prompt
        [MASK] ids excluded); the core's plan of the live rows handed to the model (``StepContext``: dLLM-Cache over
        the block's cached layers; None: its plain forward, SGLang's graph)."""
        L, dev = self.L, fb.input_ids.device
        held = self.fb  # the same batch steps until its blocks are done
        if held is None or held[0] is not fb or held[1] is not fb.req_pool_indices:
            self.fb, self.slots = (fb, fb.req_pool_indices), np.array(fb.req_pool_indices.tolist())
        slots = self.slots
        if any(s.fresh for s in states):  # a new request always starts with a fresh block
            fresh = np.array([s.fresh for s in states])
            for s in states:
                s.fresh = False
            whole, ids = bool(fresh.all()), fb.input_ids.view(fb.batch_size, L)
            f = None if whole else torch.as_tensor(fresh, device=dev)
            ids = ids if whole else ids[f]
            self.prompt_only = whole and not bool((ids == self.mask_id).any())
            if self.prompt_only:  # prompt blocks: nothing to decode (a new request is admitted at its first mask)
                return
            self.bind(model_runner, fb)
            pm = fb.dllm_prompt_mask  # the prompt's positions (its literal [MASK] ids are not decoded)
            self.lc.start(slots[fresh], ids, None if pm is None else pm if whole else pm[f])
        live = [i for i, s in enumerate(states) if not s.final]  # (lists: numpy is slower on a batch this small)
        model = model_runner.model
        ours = hasattr(model, "context")  # (SGLang's own LLaDA2 class runs every block whole, counting nothing)
        ctx = self.lc.plan(slots, live, self.opts.caching, ours)
        if ours:
            model.context = ctx

    def step(self, fb, full_logits: torch.Tensor, states: list) -> List[bool]:
        """One step of each request's block (full_logits [B * L, V]): commits written into input_ids in place;
        per row whether the block is finished with this forward having seen it final."""
        if self.prompt_only:  # prompt blocks: nothing to decode
            return [True] * fb.batch_size
        final = [s.final for s in states]
        live = [i for i, f in enumerate(final) if not f]
        if live:
            done, now = self.lc.take(self.slots, live, full_logits, fb.input_ids.view(fb.batch_size, self.L))
            for i, d, f in zip(live, done, now):
                states[i].final, final[i] = d, f
        return final


def plain_forwards_only(original, runner, forward_batch, *args, **kwargs) -> bool:
    """AROUND SGLang's ``DecodeCudaGraphRunner.can_run_graph``: a graph captured from a dllm-serve model's plain
    forward (every row through every layer) replays only for a forward with no ``StepContext``; one with cached
    layers or packed rows (data-dependent rows, or rows outside the batch's blocks) runs eager."""
    if getattr(getattr(runner.model_runner, "model", None), "context", None) is not None:
        return False
    return original(runner, forward_batch, *args, **kwargs)


def disable_radix_cache(server_args, why: str) -> None:
    """Turn the radix cache off (request-private KV slots), with a warning."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    if not resolving_view(server_args).disable_radix_cache:
        logger.warning("dllm-serve: %s -> radix cache disabled", why)
        declare_resolution(server_args, "dllm-serve", disable_radix_cache=True)


class SlowFast(DllmCoreAlgorithm):
    """SlowFast sampling (dllm_core ``slowfast``): explore one token per step until the decodable
    span is stable, then commit every confident token of the span in parallel."""

    sampler_name = "slowfast"


class FastDllmThreshold(DllmCoreAlgorithm):
    """Fast-dLLM threshold rule (dllm_core ``threshold``): commit every masked position with
    confidence >= ``tau`` (default 0.9), at least the most confident one."""

    sampler_name = "threshold"


class FastDllmFactor(DllmCoreAlgorithm):
    """Fast-dLLM factor rule (dllm_core ``factor``): commit the largest n with
    (n + 1)(1 - c_(n)) < ``f`` (default 1.0)."""

    sampler_name = "factor"


class DllmCore(DllmCoreAlgorithm):
    """Any dllm_core sampler by spec: YAML ``sampler: "low_confidence"`` + ``steps`` (per block)."""


ALGORITHMS = (SlowFast, FastDllmThreshold, FastDllmFactor, DllmCore)
