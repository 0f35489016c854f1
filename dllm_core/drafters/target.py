"""The frozen causal target: loading (local transformers checkpoint), greedy regeneration of its outputs, and
the hidden states drafters train on (only the layers asked for, a chunk of tokens at a time)."""
from __future__ import annotations

import importlib.util
from collections import defaultdict
from pathlib import Path

import torch

from .sampling import clip_at_stop


def load_target(target_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """A transformers causal LM from a local directory, frozen and in eval mode (never downloads); a device
    this machine lacks is an error naming the available ones."""
    from transformers import AutoModelForCausalLM

    from ..models import check_device

    device = check_device(device)
    d = Path(target_dir)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"--target: {d} has no config.json")
    model = AutoModelForCausalLM.from_pretrained(str(d), local_files_only=True, dtype=dtype)
    return model.to(device).eval().requires_grad_(False)


@torch.inference_mode()
def regenerate(target, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int], batch_size: int = 16,
               progress=None, free_run: bool = False) -> list[list[int]]:
    """The target's own greedy continuation of every prompt: up to and including the first stop token, or
    (``free_run``, as in a long generation) exactly ``max_new_tokens`` tokens with the stop tokens banned.

    Prompts are batched by exact length, so no padding can perturb the greedy path."""
    stops = sorted(set(stop_ids))
    if free_run:
        kw = dict(min_new_tokens=max_new_tokens, suppress_tokens=stops or None, eos_token_id=None, pad_token_id=0)
    else:
        kw = dict(eos_token_id=stops or None, pad_token_id=(stop_ids or [0])[0])
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_len[len(p)].append(i)
    out: list[list[int] | None] = [None] * len(prompts)
    for length, idx in sorted(by_len.items()):
        for s in range(0, len(idx), batch_size):
            rows = idx[s:s + batch_size]
            ids = torch.tensor([prompts[i] for i in rows], device=target.device)
            gen = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, **kw)[:, length:]
            for i, row in zip(rows, gen.tolist()):
                out[i] = row if free_run else clip_at_stop(row, max_new_tokens, stops)
            if progress is not None:
                progress.update(len(rows))
    return out


REGEN_ENGINES = ("auto", "vllm", "transformers")


def regen_engine(name: str, device: str) -> str:
    """``--regen-engine``: ``auto`` is vLLM on a GPU when it is installed, else transformers' ``generate``."""
    from ..options import check_choice

    check_choice(name, REGEN_ENGINES, "--regen-engine")
    if name != "auto":
        return name
    return "vllm" if device.startswith("cuda") and importlib.util.find_spec("vllm") else "transformers"


def vllm_engine(target_dir: str | Path, max_model_len: int, dtype: str = "float32", **engine):
    """A ``vllm.LLM`` on the local target (``engine``: extra ``LLM`` arguments); stop it with
    ``llm.llm_engine.engine_core.shutdown()``."""
    from vllm import LLM

    return LLM(model=str(target_dir), dtype=dtype, seed=0, max_model_len=max_model_len, **engine)


def regenerate_vllm(target_dir: str | Path, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
                    free_run: bool = False, llm=None) -> list[list[int]]:
    """``regenerate`` through vLLM's offline ``LLM.generate`` (continuous batching, paged KV cache): greedy,
    up to and including the first stop token, or (``free_run``) exactly ``max_new_tokens`` tokens with the
    stop tokens held back (``min_tokens``). ``llm``: a running engine (``vllm_engine``), else one is started
    for the call and stopped after it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    stops = sorted(set(stop_ids))
    if free_run:
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, min_tokens=max_new_tokens,
                                ignore_eos=True, stop_token_ids=stops)
    else:
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=stops)
    own = llm is None
    llm = llm or vllm_engine(target_dir, max(map(len, prompts)) + max_new_tokens)
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    finally:
        if own:
            llm.llm_engine.engine_core.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def regenerate_with(engine: str, target, target_dir, prompts: list[list[int]], max_new_tokens: int,
                    stop_ids: list[int], batch_size: int, progress=None, free_run: bool = False) -> list[list[int]]:
    """``regenerate`` (transformers) or ``regenerate_vllm`` by ``engine`` (``regen_engine``'s answer)."""
    if engine == "vllm":
        out = regenerate_vllm(target_dir, prompts, max_new_tokens, stop_ids, free_run)
        if progress is not None:
            progress.update(len(prompts))
        return out
    return regenerate(target, prompts, max_new_tokens, stop_ids, batch_size, progress, free_run)


@torch.no_grad()
def target_features(target, tokens: torch.Tensor, layer_ids: tuple[int, ...], chunk: int = 0) -> torch.Tensor:
    """Outputs of the target's decoder layers ``layer_ids`` (0-based; the last layer's after the final norm, as
    transformers' ``hidden_states[i + 1]``), concatenated: tokens [S, L] (right-padded) -> [S, L, k*H].

    Only these layers' states are kept (not every layer's, nor the logits); ``chunk`` > 0 runs the sequence
    ``chunk`` tokens at a time against the KV cache of the tokens before, so activation memory is bounded by
    the chunk, not by L."""
    from transformers import DynamicCache

    decoder = target.get_decoder()
    n, got = len(decoder.layers), {}
    inner = sorted({i for i in layer_ids if i < n - 1})
    hooks = [decoder.layers[i + 1].register_forward_pre_hook(
        lambda mod, args, kw, i=i: got.__setitem__(i, (args[0] if args else kw["hidden_states"])),
        with_kwargs=True) for i in inner]
    parts, cache, L = [], DynamicCache(), tokens.shape[1]
    step = chunk if 0 < chunk < L else L
    try:
        for s in range(0, L, step):
            got.clear()
            out = decoder(input_ids=tokens[:, s:s + step], past_key_values=cache, use_cache=step < L)
            got[n - 1] = out.last_hidden_state
            parts.append(torch.cat([got[i] for i in layer_ids], -1))
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(parts, 1)
