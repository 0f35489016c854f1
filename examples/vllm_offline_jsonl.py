"""Offline batch serving: push a JSONL file of prompts through ``vllm.LLM`` with a dLLM policy.

Input lines: ``{"prompt": "..."}`` plus optional per-line overrides ``"sampler"``, ``"cache"``,
``"steps"``, ``"max_tokens"``. Output lines: the input plus ``"text"``, ``"token_ids"`` and
``"seconds"`` (wall time of the whole batch).

    # GPU
    python examples/vllm_offline_jsonl.py --model GSAI-ML/LLaDA-8B-Instruct-local-dir --in prompts.jsonl \\
        --out results.jsonl --sampler threshold:tau=0.9 --cache dllm:kr=4,rho=0.25 --canvas 32 --chat
    # CPU (test-only harness: vLLM Model Runner V2 under Triton's interpreter)
    PYTHONPATH=tests/vllm_harness python examples/vllm_offline_jsonl.py --model DIR --in p.jsonl --out r.jsonl
"""
from __future__ import annotations

import argparse
import json
import time

PER_LINE = {"sampler": "dllm_sampler", "cache": "dllm_cache", "steps": "dllm_steps"}


def read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row.get("prompt"), str):
                    raise ValueError(f"{path}:{i}: every line needs a string 'prompt'")
                rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description="vLLM offline batch generation for LLaDA / Dream")
    p.add_argument("--model", required=True)
    p.add_argument("--in", dest="inp", required=True, help="JSONL prompts")
    p.add_argument("--out", required=True, help="JSONL results")
    p.add_argument("--sampler", default="low_confidence", help="server-wide dllm_core sampler spec")
    p.add_argument("--cache", default="none", help="none | dllm:kr=..,rho=..")
    p.add_argument("--steps", type=int, help="total denoising steps over the response (fixed-schedule samplers)")
    p.add_argument("--canvas", type=int, default=32, help="canvas (block) length")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--chat", action="store_true", help="wrap prompts in the tokenizer's chat template")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    a = p.parse_args()

    from vllm import LLM, SamplingParams

    rows = read_jsonl(a.inp)
    dllm = {"sampler": a.sampler, "cache": a.cache, **({"steps": a.steps} if a.steps else {})}
    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, tensor_parallel_size=a.tensor_parallel_size,
              diffusion_config={"canvas_length": a.canvas}, additional_config={"dllm": dllm})
    tok = llm.get_tokenizer()
    prompts, params = [], []
    for row in rows:
        text = row["prompt"]
        if a.chat:
            text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
        prompts.append({"prompt_token_ids": tok(text, add_special_tokens=False)["input_ids"]})
        extra = {PER_LINE[k]: row[k] for k in PER_LINE if k in row}
        params.append(SamplingParams(max_tokens=row.get("max_tokens", a.max_tokens), extra_args=extra))
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t
    with open(a.out, "w") as f:
        for row, out in zip(rows, outs):
            o = out.outputs[0]
            f.write(json.dumps({**row, "text": o.text, "token_ids": list(o.token_ids), "seconds": round(seconds, 3)})
                    + "\n")
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{len(rows)} prompts, {n_tok} tokens in {seconds:.2f} s ({n_tok / max(seconds, 1e-9):.1f} tok/s) -> {a.out}")


if __name__ == "__main__":
    main()
