"""``dllm`` command line: generate with the embedded reference engine."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

DTYPES = ("float32", "bfloat16", "float16")
# modules that register a subcommand through `add_parser(subparsers)`
SUBCOMMANDS = ["dllm_core.demo", "dllm_core.stepbench", "dllm_core.train.mdm", "dllm_core.tasks.evaluate",
               "dllm_core.train.ar", "dllm_core.bench"]
SUBCOMMANDS += ["dllm_core.drafters.cli"]  # DFlash: train-dflash, bench-dflash
SUBCOMMANDS += ["dllm_core.drafters.tokenswift.cli"]  # TokenSwift: train-tokenswift, bench-long


def add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gen-length", type=int, default=128)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--steps", type=int, default=None,
                   help="total denoising steps over the response, fixed-schedule samplers (default: --gen-length)")
    p.add_argument("--sampler", default="low_confidence",
                   help="name[:k=v,...]: low_confidence, random, threshold, factor, slowfast, maskgit_plus, "
                        "topk_margin, entropy, origin")
    p.add_argument("--cache", default="none", help="name[:k=v,...]: none, prefix, dual, dllm, dpad, elastic")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--cfg-scale", type=float, default=0.0)
    p.add_argument("--logits-eos-inf", action="store_true")
    p.add_argument("--confidence-eos-eot-inf", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help=f"one of {', '.join(DTYPES)}")


def generation_config(a: argparse.Namespace, tok=None):
    from .engine import GenerationConfig
    from .tokenizer import special_id

    eot = None
    if tok is not None:
        eot = special_id(tok, "<|eot_id|>") or special_id(tok, "<|im_end|>")
    return GenerationConfig(
        gen_length=a.gen_length, block_length=a.block_length, steps=a.steps, sampler=a.sampler, cache=a.cache,
        temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, cfg_scale=a.cfg_scale,
        logits_eos_inf=a.logits_eos_inf, confidence_eos_eot_inf=a.confidence_eos_eot_inf, eot_id=eot, seed=a.seed,
        logprobs=getattr(a, "logprobs", None))


def torch_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise ValueError(f"--dtype must be one of {list(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def decode(tok, ids: list[int], stop: set[int]) -> str:
    """Text of the generated ids up to the first EOS/EOT, special tokens dropped."""
    cut = next((i for i, t in enumerate(ids) if t in stop), len(ids))
    return tok.decode(ids[:cut], skip_special_tokens=True)


def stop_ids(tok, model) -> set[int]:
    from .tokenizer import special_id

    ids = {model.args.eos_token_id, special_id(tok, "<|eot_id|>"), special_id(tok, "<|im_end|>")}
    return {i for i in ids if i is not None}


def cmd_generate(a) -> int:
    from . import encode_prompt, generate, load_model, load_tokenizer

    cfg = generation_config(a)  # validate options before loading anything
    model = load_model(a.model, a.device, torch_dtype(a.dtype))
    tok = load_tokenizer(a.model)
    cfg = generation_config(a, tok)
    prompts = [encode_prompt(tok, p, a.chat) for p in a.prompt]
    res = generate(model, prompts, cfg)
    stop = stop_ids(tok, model)
    rows = [{"prompt": p, "text": decode(tok, ids, stop), "token_ids": ids, "nfe": n}
            for p, ids, n in zip(a.prompt, res.tokens.tolist(), res.nfe)]
    if res.logprobs is not None:  # per answer token: its log-probability, the step's top alternatives
        for r, lp in zip(rows, res.logprobs.rows()):
            r["logprobs"], r["top_logprobs"] = [t["logprob"] for t in lp], [t["top"] for t in lp]
    if a.json:
        out = {"seconds": res.seconds, "work_ratio": res.counters.ratio(), "cache_bytes": res.counters.cache_bytes,
               "results": rows}
        if len(rows) == 1:
            out.update(rows[0])
        print(json.dumps(out))
    else:
        for r in rows:
            print(r["text"])
        print(f"[nfe {res.nfe}  {res.seconds:.2f}s  work {res.counters.ratio():.3f} of uncached]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dllm", description="Diffusion LLM serving toolkit (embedded engine)")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="denoise a response for one or more prompts")
    g.add_argument("--model", required=True,
                   help="local HF checkpoint directory (LLaDA, Dream or LLaDA2; LLaDA2: --block-length = its block_size)")
    g.add_argument("--prompt", required=True, action="append", help="repeat for a batch")
    g.add_argument("--chat", action="store_true", help="wrap the prompt with the tokenizer's chat template")
    g.add_argument("--json", action="store_true")
    g.add_argument("--logprobs", type=int, default=None,
                   help="with --json: each answer token's log-probability under the step that committed it and that "
                        "step's top k alternatives (0-20)")
    add_generation_args(g)
    g.set_defaults(func=cmd_generate)
    for mod in SUBCOMMANDS:
        importlib.import_module(mod).add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """``dllm`` (``argv``: the arguments; None: the process's own). Returns the exit code."""
    a = build_parser().parse_args(argv)
    try:
        code = a.func(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"dllm {a.cmd}: error: {e}", file=sys.stderr)
        code = 2
    if argv is None:
        leave_worker(code)
    return code


def leave_worker(code: int) -> None:
    """A ``torchrun`` worker whose command has finished (process group destroyed, files closed) exits here,
    skipping the interpreter's teardown: gloo's C++ threads can abort it (``terminate called without an
    active exception``, SIGABRT), which fails the whole job after its work is done."""
    from .train.distributed import is_worker

    if is_worker():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


if __name__ == "__main__":
    sys.exit(main())
