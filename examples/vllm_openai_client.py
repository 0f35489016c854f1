"""Batch serving through the OpenAI-compatible server: push a JSONL file of prompts concurrently
to ``/v1/completions`` with per-line dLLM options (``vllm_xargs``), write JSONL results.

Start a server first (GPU)::

    dllm-vllm-serve /path/to/LLaDA-8B-Instruct --diffusion-config '{"canvas_length": 32}' \\
        --dllm-sampler threshold:tau=0.9 --dllm-cache dllm:kr=4,rho=0.25 --port 8000

then::

    python examples/vllm_openai_client.py --url http://127.0.0.1:8000/v1 --in prompts.jsonl --out results.jsonl

Input lines: ``{"prompt": "..."}`` plus optional ``"sampler"``, ``"cache"``, ``"steps"``,
``"max_tokens"``. A line whose options the server rejects (HTTP 400) gets an ``"error"`` field;
the others are unaffected.
"""
from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

from vllm_offline_jsonl import PER_LINE, read_jsonl


def complete(client, model: str, row: dict, max_tokens: int, chat: bool) -> dict:
    import openai

    xargs = {PER_LINE[k]: row[k] for k in PER_LINE if k in row}
    t = time.perf_counter()
    try:
        if chat:
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": row["prompt"]}],
                                               max_tokens=row.get("max_tokens", max_tokens),
                                               extra_body={"vllm_xargs": xargs} if xargs else None)
            text = r.choices[0].message.content
        else:
            r = client.completions.create(model=model, prompt=row["prompt"],
                                          max_tokens=row.get("max_tokens", max_tokens),
                                          extra_body={"vllm_xargs": xargs} if xargs else None)
            text = r.choices[0].text
        return {**row, "text": text, "completion_tokens": r.usage.completion_tokens,
                "seconds": round(time.perf_counter() - t, 3)}
    except openai.BadRequestError as e:
        return {**row, "error": str(e)}


def main() -> None:
    p = argparse.ArgumentParser(description="JSONL batch client for a vLLM server serving LLaDA / Dream")
    p.add_argument("--url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", help="served model name (default: the server's first model)")
    p.add_argument("--in", dest="inp", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    a = p.parse_args()

    import openai

    client = openai.OpenAI(base_url=a.url, api_key="EMPTY")
    model = a.model or client.models.list().data[0].id
    rows = read_jsonl(a.inp)
    t = time.perf_counter()
    with ThreadPoolExecutor(a.concurrency) as pool:
        results = list(pool.map(lambda r: complete(client, model, r, a.max_tokens, a.chat), rows))
    seconds = time.perf_counter() - t
    with open(a.out, "w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    ok = [r for r in results if "error" not in r]
    n_tok = sum(r["completion_tokens"] for r in ok)
    print(f"{len(ok)}/{len(rows)} ok, {n_tok} tokens in {seconds:.2f} s ({n_tok / max(seconds, 1e-9):.1f} tok/s)"
          f" -> {a.out}")


if __name__ == "__main__":
    main()
