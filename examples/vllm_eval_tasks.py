"""Accuracy of a LLaDA-architecture checkpoint on a task's test split: served by vLLM vs the
embedded reference engine with the same policy (and vanilla LLaDA decoding for comparison).

    # CPU (test-only harness runs vLLM's Model Runner V2 under Triton's interpreter):
    PYTHONPATH=tests/vllm_harness python examples/vllm_eval_tasks.py --model models/llada-tasks \\
        --task arithmetic --n 200 --sampler low_confidence
    # GPU: the same without PYTHONPATH (add --dtype bfloat16 to match a bf16 deployment)

Prints one JSON object: accuracies (vLLM, the embedded engine with the same policy, vanilla
``none``), the token agreement of vLLM with that reference, and of the policy with vanilla.
"""
from __future__ import annotations

import argparse
import json
import time

from dataclasses import replace

import torch

from dllm_core import load_model, load_tokenizer
from dllm_core.cache import CanvasCache, DLLMCache, host_cache
from dllm_core.cli import stop_ids
from dllm_core.tasks import make_task
from dllm_core.tasks.evaluate import accuracy, agreement, generate_batched, prompts_of, task_config


def run_vllm(args, task, prompts, steps: int) -> tuple[list[list[int]], float]:
    from vllm import LLM, SamplingParams

    dllm = {"sampler": args.sampler, "cache": args.cache, "steps": steps, "block_length": task.block_length,
            "stream": args.stream}
    llm = LLM(model=args.model, tokenizer=args.model, dtype=args.dtype, enforce_eager=True,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, seed=0,
              diffusion_config={"canvas_length": args.blocks * task.block_length}, additional_config={"dllm": dllm})
    sp = SamplingParams(max_tokens=task.gen_length, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--task", default="arithmetic")
    p.add_argument("--n", type=int, default=200, help="test examples")
    p.add_argument("--sampler", default="low_confidence")
    p.add_argument("--cache", default="dual", help="vLLM cache option (dual | prefix | none | canvas | dllm:...)")
    p.add_argument("--blocks", type=int, default=None, help="task blocks per vLLM canvas (canvas_length = blocks x "
                   "the task's block length; gen_length / block_length = the whole response in one canvas)")
    p.add_argument("--stream", action="store_true", help="emit each block when decoded, the next canvas being the "
                   "rest of the response (prefix / dual)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--out", help="also write the JSON result here")
    args = p.parse_args()

    task, tok = make_task(args.task), load_tokenizer(args.model)
    model = load_model(args.model, dtype=getattr(torch, args.dtype))
    examples = task.examples("test", args.n)
    prompts, stop = prompts_of(tok, examples), stop_ids(tok, model)
    args.blocks = args.blocks or task.gen_length // task.block_length  # default: the whole response
    canvas_len = args.blocks * task.block_length
    policy = host_cache(args.cache)
    if isinstance(policy, CanvasCache):
        policy = replace(policy, blocks=args.blocks)
    ref_cfg, vanilla_cfg = task_config(task, args.sampler, policy), task_config(task, args.sampler, "none")
    # a host request keeps its own dLLM-Cache step counter; an embedded batch shares one: unbatched rows
    ref = generate_batched(model, prompts, ref_cfg, batch_size=1 if isinstance(policy, DLLMCache) else 32,
                           canvas_length=canvas_len)
    van = generate_batched(model, prompts, vanilla_cfg, batch_size=32)
    got, seconds = run_vllm(args, task, prompts, ref_cfg.steps)
    result = {
        "model": args.model, "task": args.task, "n": len(examples), "sampler": args.sampler, "cache": args.cache,
        "canvas_length": args.blocks * task.block_length, "block_length": task.block_length, "stream": args.stream,
        "dtype": args.dtype,
        "accuracy": {"vllm": accuracy(task, tok, stop, examples, got), "reference": accuracy(task, tok, stop, examples,
                     ref.tokens), "reference_vanilla": accuracy(task, tok, stop, examples, van.tokens)},
        "agreement_vllm_vs_reference": agreement(got, ref.tokens),
        "agreement_reference_vs_vanilla": agreement(ref.tokens, van.tokens),
        "seconds": {"vllm": round(seconds, 2), "reference": round(ref.seconds, 2),
                    "reference_vanilla": round(van.seconds, 2)},
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
