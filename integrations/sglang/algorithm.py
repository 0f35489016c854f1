"""dllm_core samplers as SGLang dLLM algorithms (``--dllm-algorithm SlowFast`` ...).

SGLang calls ``step(forward_batch, full_logits, states)`` after every forward of a block:
``input_ids`` [B * block] holds each request's block (prompt tail + masks + committed tokens),
``full_logits`` [B * block, V] its logits. The adapter views them as [B, block] and runs the
core's step (``dllm_core.engine.step.denoise_step``: the loop body of every engine), writes the
commits back into ``input_ids`` in place and reports per row whether the block is finished with this
forward having seen it final (``block_final``: done before the step, or - token editing - finished by a
step that changed nothing; SGLang's contract: the forward after the last change persists the block's K/V).

With Fast-dLLM's ``cache: prefix`` / ``dual`` or dLLM-Cache's ``cache: dllm`` the algorithm instead runs the
embedded engine's loop over each request's whole response (``response.ResponseHost``): SGLang's block is a
window onto it.

Per-request sampler state (dllm_core's dict of [B, ...] tensors) lives in the core's ``SlotStates``,
one row per SGLang request slot (``req_pool_indices``): batches change between rounds
(``--dllm-fdfo``, the default), so a step gathers its rows and writes them back. SGLang keeps a
``RowState`` per request (dLLM-Cache step counter, flags) across rounds.
"""
from __future__ import annotations

import logging
from typing import Any, ClassVar, List

import torch

from dllm_core.engine.step import SlotGroups, block_final, denoise_step, mask_in_prompt
from dllm_core.options import OptionError
from dllm_core.sampling import TokenContext

from sglang.srt.dllm.algorithm.base import DllmAlgorithm
from sglang.srt.dllm.config import DllmConfig

from .response import BATCH, ResponseHost
from .options import CACHE_KEY, AlgorithmOptions, read_yaml, with_default_cache

logger = logging.getLogger(__name__)


class DllmServeConfig(DllmConfig):
    """SGLang's ``DllmConfig`` for the dllm-serve models + dllm_core's prompt rule and response rule at admission
    (the scheduler answers a returned error with HTTP 400): no mask token in a prompt, ``max_new_tokens`` >= 1
    (decoded in whole blocks) and a ``steps`` total that splits evenly over them."""

    def validate_request(self, req) -> str | None:
        return (mask_in_prompt(req.origin_input_ids, self.mask_id) or self.response_error(req)
                or super().validate_request(req))

    def response_error(self, req) -> str | None:
        opts, sp = self.options(), getattr(req, "sampling_params", None)
        if opts is None or sp is None:
            return None
        try:
            opts.response(sp.max_new_tokens or 0, self.block_size)
        except OptionError as e:
            return f"{self.algorithm}: {e}"
        return None

    def options(self):
        """The algorithm's parsed options (None: not one of ours)."""
        if not hasattr(self, "_opts"):
            from sglang.srt.dllm.algorithm import get_algorithm_cls

            cls = get_algorithm_cls(self.algorithm)
            self._opts = cls.options(self.algorithm_config or {}) if hasattr(cls, "options") else None
        return self._opts

    def policy(self):
        """The algorithm's policy over the whole response (None: SGLang's block canvas, or not one of ours)."""
        return None if self.options() is None else self.options().policy


class RowState:
    """One request's block in flight: its dLLM-Cache step counter and flags (its sampler rows live in
    the algorithm's ``SlotStates``, at the request's slot)."""

    __slots__ = ("step", "final", "fresh", "steps")

    def __init__(self):
        self.step = 0        # denoise forwards of this block so far (dLLM-Cache schedule)
        self.final = False   # the block has no masks left: the next forward persists it (exact)
        self.fresh = True    # the sampler rows are reset at the block's first step
        self.steps = 0       # the request's steps per block (set at the block's first step)


class DllmCoreAlgorithm(DllmAlgorithm):
    """Base adapter; subclasses name the dllm_core sampler (``sampler_name``)."""

    sampler_name: ClassVar[str | None] = None

    @classmethod
    def options(cls, cfg: dict) -> AlgorithmOptions:
        return AlgorithmOptions.parse(cls.__name__, cls.sampler_name, cfg)

    @classmethod
    def configure_server_args(cls, server_args) -> None:
        """Launch-time: validate the YAML (fail before any worker starts) and turn off what
        dLLM-Cache cannot run with (CUDA graphs; tensor parallelism is refused) and what Fast-dLLM
        cannot (CUDA graphs; the radix cache: a refresh rewrites the prefix K/V in place)."""
        from sglang.srt.arg_groups.overrides import resolving_view

        from .plugin import ARCHS, model_architecture

        cfg = resolving_view(server_args)
        path, arch = cfg.dllm_algorithm_config, model_architecture(server_args)
        try:  # our model classes default to a policy over the whole response
            opts = cls.options(with_default_cache(read_yaml(path), arch in ARCHS))
        except ValueError as e:
            raise ValueError(f"--dllm-algorithm-config {path}: {e}") from None
        if opts.caching or opts.policy is not None:
            key = "dllm_cache" if opts.caching else f"cache: {opts.policy.name}"
            if arch not in ARCHS:
                raise ValueError(f"--dllm-algorithm-config {path}: {cls.__name__}.{key} needs one of the "
                                 f"dllm-serve models {list(ARCHS)}, got {arch}")
        if opts.policy is not None:
            name = opts.policy.name
            kind = "dLLM-Cache" if opts.policy.picks else "Fast-dLLM"
            if opts.policy.picks and cfg.tp_size > 1:
                raise ValueError(f"--dllm-algorithm-config {path}: {cls.__name__}.cache: {name} needs --tp-size 1 "
                                 f"(its V-verify selection is per rank), got --tp-size {cfg.tp_size}")
            disable_cuda_graphs(server_args, f"{cls.__name__}: cache {name} ({kind}) runs data-dependent rows")
            disable_radix_cache(server_args, f"{cls.__name__}: cache {name} ({kind}) rewrites each request's "
                                             f"prefix K/V in place")
        if opts.caching:
            if cfg.tp_size > 1:
                raise ValueError(f"--dllm-algorithm-config {path}: {cls.__name__}.{CACHE_KEY} needs --tp-size 1 "
                                 f"(its V-verify selection is per rank), got --tp-size {cfg.tp_size}")
            disable_cuda_graphs(server_args, f"{cls.__name__}: dllm_cache (dLLM-Cache) has data-dependent shapes")

    def __init__(self, config: DllmConfig):
        super().__init__(config)
        self.opts = self.options(config.algorithm_config or {})
        self.sampler = self.opts.sampler
        self.steps = self.opts.decode.steps or self.block_size  # the most steps a block can take
        self._tc: TokenContext | None = None
        self.rows: SlotGroups | None = None  # per-request sampler rows, by request slot and steps per block
        self.whole = None if self.opts.policy is None else ResponseHost(
            self.opts.policy, self.opts, self.block_size, self.mask_id)

    def block_steps(self, reqs) -> list[int]:
        """Each request's denoising steps per block: its ``steps`` split over its response's blocks
        (``max_new_tokens`` in whole blocks; dllm_core's response rule)."""
        if self.opts.decode.steps is None or not self.sampler.fixed_steps:
            return [self.block_size] * len(reqs)
        return [self.opts.response(r.sampling_params.max_new_tokens, self.block_size).steps_per_block for r in reqs]

    def max_steps(self, block_size: int) -> int:
        """Forwards per block in the synchronous loop: the sampler's most steps + the forward
        that persists the block (Fast-dLLM: a block of SGLang's may span two of the canvas)."""
        return self.sampler.max_steps(block_size, self.steps) * (2 if self.whole else 1) + 1

    def token_context(self, device) -> TokenContext:
        if self._tc is None:
            o = self.opts.decode
            gen = torch.Generator(device).manual_seed(o.seed)
            self._tc = TokenContext(self.mask_id, o.temperature, o.top_p, o.top_k, generator=gen)
        return self._tc

    def masked(self, forward_batch) -> torch.Tensor:
        """[B, block] positions still to denoise (prompt tokens excluded, literal masks too)."""
        ids = forward_batch.input_ids.view(forward_batch.batch_size, self.block_size)
        m = ids == self.mask_id
        pm = forward_batch.dllm_prompt_mask
        return m if pm is None else m & ~pm

    def init_step_state(self, forward_batch) -> List[Any]:
        return [RowState() for _ in range(forward_batch.batch_size)]

    def sampler_rows(self, forward_batch, states: List[Any], masked: torch.Tensor) -> list:
        """The batch's rows grouped by steps per block: [(rows, their request slots, their SlotStates, key)]
        (fresh blocks get new sampler rows)."""
        slots = forward_batch.req_pool_indices.tolist()
        if self.rows is None:
            self.rows = SlotGroups(self.sampler, self.block_size, masked.device)
        fresh = [i for i, s in enumerate(states) if s.fresh]
        if fresh:
            need = self.opts.decode.steps is not None and self.sampler.fixed_steps
            reqs = BATCH.requests(slots) if need else [None] * len(slots)
            for i, n in zip(fresh, self.block_steps([reqs[i] for i in fresh])):
                states[i].steps, states[i].fresh = n, False
        groups = self.rows.split(slots, [s.steps for s in states])
        for rows, idx, ss, _ in groups:
            new = [j for j, i in enumerate(rows) if i in fresh]
            if new:
                ss.reset(idx[new], masked[[rows[j] for j in new]])
        return groups

    def prepare_inputs(self, model_runner, forward_batch, states: List[Any]) -> None:
        """dLLM-Cache: hand the model its cache policy and each row's denoise step
        (``dllm_input_preparation_state``, CPU int64 [B]; -1 = persisting forward, exact).
        Fast-dLLM: plan the step of each request's canvas (``ResponseHost.prepare``)."""
        if self.whole is not None:
            return self.whole.prepare(model_runner, forward_batch)
        if not self.opts.caching:
            return
        fc = getattr(model_runner.model, "feature_cache", None)
        if fc is None:
            raise ValueError(f"{type(self).__name__}.{CACHE_KEY} needs a dllm-serve model class (LLaDAModelLM, "
                             f"DreamModel), got {type(model_runner.model).__name__}")
        fc.configure(self.opts.cache)
        forward_batch.dllm_input_preparation_state = torch.tensor([-1 if s.final else s.step for s in states])
        for s in states:
            s.step += not s.final

    def step(self, forward_batch, full_logits: torch.Tensor, states: List[Any]) -> List[bool]:
        """One sampler step on input_ids [B * L] with full_logits [B * L, V]: commits written into
        input_ids in place; returns per row whether its block had no masks *before* the step.
        Fast-dLLM: one step of each request's canvas; per row whether SGLang's block is decoded."""
        if self.whole is not None:
            return self.whole.step(forward_batch, full_logits)
        B, L = forward_batch.batch_size, self.block_size
        ids = forward_batch.input_ids.view(B, L)
        masked = self.masked(forward_batch)
        if all(s.fresh for s in states) and not bool(masked.any()):  # prompt blocks: nothing to decode
            return [True] * B
        logits = full_logits.view(B, L, -1)
        pm = forward_batch.dllm_prompt_mask  # literal [MASK] ids inside the prompt are not to decode
        x = ids if pm is None else torch.where(masked | (ids != self.mask_id), ids, -1)
        before, tc = ids.clone(), self.token_context(ids.device)
        done, after = (torch.zeros(B, dtype=torch.bool, device=ids.device) for _ in range(2))
        for rows, slots, ss, key in self.sampler_rows(forward_batch, states, masked):
            r = slice(None) if len(rows) == B else torch.tensor(rows, device=ids.device)  # one group: no copies
            st = ss.gather(slots, key)
            done[r] = d = self.sampler.rows_done(st, masked[r])
            if bool(d.all()):
                after[r] = True
                continue
            xr, after[r] = denoise_step(self.sampler, st, logits[r], x[r], tc)
            ss.scatter(slots, st, key)
            ids[r] = torch.where(xr == -1, ids[r], xr)  # in place: forward_batch.input_ids
        if bool(done.all()):
            return done.tolist()
        if self.opts.caching:  # rows whose block is done: their next forward persists it
            for s, final in zip(states, after.tolist()):
                s.final = final
        return block_final(done, before, ids, after).tolist()


def disable_cuda_graphs(server_args, why: str) -> None:
    """Turn CUDA graphs off for both phases (as SGLang does on HIP), with a warning."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    for phase in Phase.ALL:
        graphs = resolving_view(server_args).cuda_graph_config
        if graphs is not None and getattr(graphs, phase).backend != Backend.DISABLED:
            logger.warning("dllm-serve: %s -> CUDA graphs disabled for the %s phase", why, phase)
            declare_resolution(server_args, "dllm-serve", cuda_graph_config=with_phase(graphs, phase,
                                                                                      backend=Backend.DISABLED))


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
