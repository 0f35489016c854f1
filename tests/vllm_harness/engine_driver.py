"""TEST-ONLY: run ONE vLLM engine (under this directory's CPU harness) over a JSON job.

stdin:  {"model": DIR, "engine": {LLM kwargs}, "batches": [[{"prompt_token_ids": [...],
         "params": {SamplingParams kwargs}}, ...], ...], "invalid": [{...same...}, ...],
         "before": {"fn": "module:function", ...kwargs}, "report": {"fn": "module:function", ...kwargs},
         "env": {NAME: value}}
stdout: a line ``RESULT {"batches": [[token ids per request], ...], "cached": [[prompt tokens read from the
         prefix cache per request], ...], "invalid": [error text | null],
         "seconds": {"startup": s, "generate": s}}`` (+ ``"work"``: per batch, each request's work
         counters from the dllm adapter, when the job sets ``"work": true``; + ``"report"``: what the report
         function returned)

Each batch is submitted at once (the engine batches the requests concurrently); ``invalid``
requests are submitted one by one and must be rejected at admission. ``before(llm, **kwargs)`` runs once the
engine is up, ``report(llm, **kwargs)`` after the batches (a JSON-able answer): with the engine core in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as ``jobs.start_engine`` runs it) they read the engine's own
objects (``reports/`` holds them).
"""
import importlib
import json
import sys
import time


def call(spec: dict | None, llm):
    if not spec:
        return None
    module, name = spec["fn"].split(":")
    return getattr(importlib.import_module(module), name)(llm, **{k: v for k, v in spec.items() if k != "fn"})


def main() -> None:
    run(json.load(sys.stdin))


def run(job: dict) -> None:
    """The job's engine, batches, invalid requests and report; prints the RESULT line."""
    import os

    from vllm import LLM, SamplingParams

    os.environ.update(job.get("env") or {})  # read by vLLM when the engine starts (this process only: a fork)
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], tokenizer=job["model"], **job["engine"])
    t1 = time.perf_counter()
    call(job.get("before"), llm)
    out = {"batches": [], "invalid": []}
    for batch in job["batches"]:
        res = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in batch],
                           [SamplingParams(**r["params"]) for r in batch], use_tqdm=False)
        out["batches"].append([list(o.outputs[0].token_ids) for o in res])
        out.setdefault("cached", []).append([o.num_cached_tokens for o in res])  # prompt tokens from the prefix cache
        if any(r["params"].get("logprobs") is not None for r in batch):  # per token: [[id, logprob, rank], ...]
            out.setdefault("logprobs", []).append([None if o.outputs[0].logprobs is None else [
                [[t, lp.logprob, lp.rank] for t, lp in d.items()] for d in o.outputs[0].logprobs] for o in res])
        if job.get("work"):  # the dllm adapter's per-request work counters, in batch order
            from integrations.vllm.state import work_counters

            work = work_counters(llm)
            out.setdefault("work", []).append([work.get(o.request_id) or next(
                (w for k, w in work.items() if k.startswith(o.request_id + "-")), None) for o in res])
    for r in job.get("invalid", []):
        try:
            llm.generate([{"prompt_token_ids": r["prompt_token_ids"]}], SamplingParams(**r["params"]), use_tqdm=False)
            out["invalid"].append(None)
        except Exception as e:  # noqa: BLE001 - vLLM raises VLLMValidationError (a client error)
            out["invalid"].append(f"{type(e).__name__}: {e}")
    if job.get("report"):
        out["report"] = call(job["report"], llm)
    out["seconds"] = {"startup": t1 - t0, "generate": time.perf_counter() - t1}
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
