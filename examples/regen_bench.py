"""Regeneration speed: the target's greedy responses to the same training prompts through transformers'
batched ``generate`` (``--regen-engine transformers``, today's path) and through vLLM's offline
``LLM.generate`` (``--regen-engine vllm``); outputs compared token for token.

    python examples/regen_bench.py --target models/qwen3-tasks --tasks "arithmetic;sort" --num-prompts 256

Prints one JSON line: seconds and tokens/s of each engine (vLLM's engine start-up timed apart), the speed
ratio without and with the start-up, and how many responses are identical."""
from __future__ import annotations

import argparse
import json
import time


def main(argv: list[str] | None = None) -> int:
    import torch

    from dllm_core.drafters.target import load_target, regenerate, regenerate_vllm, vllm_engine
    from dllm_core.tasks import parse_tasks
    from dllm_core.tokenizer import encode_prompt, load_tokenizer
    from dllm_core.train.dflash import stop_ids

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="models/qwen3-tasks")
    p.add_argument("--tasks", default="arithmetic;sort")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--regen-batch", type=int, default=32, help="prompts per transformers generate call")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    tok, target = load_tokenizer(a.target), load_target(a.target)
    tasks = parse_tasks(a.tasks)
    per = -(-a.num_prompts // len(tasks))
    prompts = [encode_prompt(tok, ex.prompt, True) for t in tasks for ex in t.examples("train", per)][:a.num_prompts]
    stops = stop_ids(tok, target.config)
    t0 = time.perf_counter()
    hf = regenerate(target, prompts, a.max_new_tokens, stops, a.regen_batch)
    t_hf = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm = vllm_engine(a.target, max(map(len, prompts)) + a.max_new_tokens)
    t_start = time.perf_counter() - t0
    t0 = time.perf_counter()
    vl = regenerate_vllm(a.target, prompts, a.max_new_tokens, stops, llm=llm)
    t_vl = time.perf_counter() - t0
    llm.llm_engine.engine_core.shutdown()
    toks = sum(map(len, hf))
    print(json.dumps({"target": a.target, "prompts": len(prompts), "tokens": toks, "transformers_s": round(t_hf, 2),
                      "vllm_startup_s": round(t_start, 2), "vllm_s": round(t_vl, 2),
                      "transformers_tok_s": round(toks / t_hf, 1), "vllm_tok_s": round(toks / t_vl, 1),
                      "speedup": round(t_hf / t_vl, 2), "speedup_with_startup": round(t_hf / (t_vl + t_start), 2),
                      "identical": sum(a == b for a, b in zip(hf, vl)), "threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
