"""The frozen causal target: loading (local transformers checkpoint) and greedy response regeneration."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch


def load_target(target_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """A transformers causal LM from a local directory, frozen and in eval mode (never downloads)."""
    from transformers import AutoModelForCausalLM

    d = Path(target_dir)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"--target: {d} has no config.json")
    model = AutoModelForCausalLM.from_pretrained(str(d), local_files_only=True, dtype=dtype)
    return model.to(device).eval().requires_grad_(False)


@torch.inference_mode()
def regenerate(target, prompts: list[list[int]], max_new_tokens: int, eos_ids: list[int], batch_size: int = 16,
               progress=None) -> list[list[int]]:
    """The target's own greedy responses (up to and including the first EOS) for every prompt.

    Prompts are batched by exact length, so no padding can perturb the greedy path."""
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_len[len(p)].append(i)
    out: list[list[int] | None] = [None] * len(prompts)
    eos = set(eos_ids)
    for length, idx in sorted(by_len.items()):
        for s in range(0, len(idx), batch_size):
            rows = idx[s:s + batch_size]
            ids = torch.tensor([prompts[i] for i in rows], device=target.device)
            gen = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, eos_token_id=list(eos) or None,
                                  pad_token_id=(eos_ids or [0])[0])[:, length:]
            for i, row in zip(rows, gen.tolist()):
                cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
                out[i] = row[:cut]
            if progress is not None:
                progress.update(len(rows))
    return out
