"""TEST-ONLY: what ``engine_driver.py`` runs inside a vLLM engine's process, before (``before``) and after
(``report``) a job's batches; the engine core runs in that process, so its scheduler, runner and proposer are
reachable. Each function takes the ``vllm.LLM`` first and the job's keyword arguments."""
from __future__ import annotations

SPEC = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")
_BEFORE: dict = {}
_SEEN: list[tuple[int, int]] = []


def spec_metrics(llm) -> dict:
    """vLLM's own speculative-decoding counters (drafts, accepted tokens); none where the engine logs no stats."""
    if not llm.llm_engine.log_stats:
        return {}
    return {m.name: m.value for m in llm.get_metrics() if m.name in SPEC}


def proposer(llm):
    """The engine's drafter (the runner's proposer object)."""
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner.drafter


def _counters(llm) -> dict:
    stats = getattr(proposer(llm), "stats", None)
    return {**spec_metrics(llm), **({f"stats.{k}": v for k, v in stats.items()} if stats else {})}


def snapshot(llm, record_proposals: bool = False) -> None:
    """``before``: the counters now (``counters`` reports what the batches added); ``record_proposals``: every
    ``propose`` call's asked draft count and the longest draft it returned (``counters``' ``proposals``)."""
    _BEFORE.update(_counters(llm))
    if record_proposals:
        drafter = proposer(llm)
        propose = drafter.propose

        def recorded(*args, **kwargs):
            out = propose(*args, **kwargs)
            _SEEN.append((drafter.num_speculative_tokens, max(map(len, out), default=0)))
            return out

        drafter.propose = recorded


class Cycle:
    """A draft count per scheduled step, in turn (vLLM's ``dynamic_sd_lookup``, read once per step)."""

    def __init__(self, counts: list[int]):
        self.counts, self.n = counts, 0

    def __getitem__(self, batch: int) -> int:
        self.n += 1
        return self.counts[(self.n - 1) % len(self.counts)]


def cycled_drafts(llm, counts: list[int], patched: bool) -> None:
    """``before``: ``snapshot``, then the engine's scheduler drafts ``counts`` in turn, one per step; ``patched``: the
    runner with the plugin's patches (a step that drafts nothing runs no DFlash proposer, its context deferred), else
    vLLM's own (the drafter runs at every step, its drafts discarded where the count is 0)."""
    snapshot(llm)
    llm.llm_engine.engine_core.engine_core.scheduler.dynamic_sd_lookup = Cycle(counts)
    if patched:
        from integrations.vllm.spec import patch_runner

        patch_runner()


def counters(llm) -> dict:
    """``report``: what the batches added to vLLM's speculative counters and the proposer's own ``stats``, the
    proposer's class, whether it holds heads / pads its drafts, and the recorded proposals."""
    drafter = proposer(llm)
    now = _counters(llm)
    return {"added": {k: v - _BEFORE.get(k, 0) for k, v in now.items()},
            "proposer": f"{type(drafter).__module__}.{type(drafter).__qualname__}",
            "heads": getattr(drafter, "heads", None) is not None, "pad": bool(getattr(drafter, "pad", False)),
            "proposals": _SEEN}


def regenerate(llm, target: str, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> dict:
    """``report``: ``regenerate_vllm`` on this engine, greedy to a stop (``"stop"``) and free-running
    (``"free_run"``)."""
    from dllm_core.drafters.target import regenerate_vllm

    return {name: regenerate_vllm(target, prompts, max_new_tokens, stop_ids, free, llm)
            for name, free in (("stop", False), ("free_run", True))}


def weight_dtypes(llm) -> dict:
    """Each distinct parameter dtype of the served model -> how many parameters hold it (what a ``quantization``
    turned the weights into)."""
    core = llm.llm_engine.engine_core.engine_core
    model = core.model_executor.driver_worker.worker.model_runner.model
    out: dict = {}
    for p in model.parameters():
        out[str(p.dtype)] = out.get(str(p.dtype), 0) + p.numel()
    return out
