"""Speculative drafters in the server's ``--dtype`` (the core's rule, ``dllm_core.drafters.dtypes``); the gap and its
two hooks: ``patches/sglang/README.md``."""
from __future__ import annotations

import torch

from dllm_core.drafters.dtypes import drafter_dtype, dtype_label

EMBEDS_HOOK = "sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs"
OPTION = "--dtype"


def embeds_in_runner_dtype(kwargs, runner, forward_batch, *args, **_):
    """AFTER ``ModelRunner._extend_forward_kwargs`` (which casts them to bfloat16): a draft runner's ``input_embeds``
    in its own dtype; other runners, and batches with replaced embeddings, as SGLang built them."""
    embeds = forward_batch.input_embeds
    given = kwargs.get("input_embeds") if isinstance(kwargs, dict) else None
    if (getattr(runner, "is_draft_worker", False) and embeds is not None and given is not None
            and forward_batch.replace_embeds is None and given.dtype != runner.dtype):
        kwargs["input_embeds"] = embeds.to(runner.dtype)
    return kwargs


def check_dflash_dtype(target_dtype: torch.dtype, embeds_follow: bool) -> torch.dtype:
    """The DFLASH drafter's dtype beside a target in ``target_dtype``; without the embeddings hook (``embeds_follow``
    False) only bfloat16 is served: anything else is refused at launch, not at the first request."""
    dtype = drafter_dtype(target_dtype, OPTION)
    if dtype != torch.bfloat16 and not embeds_follow:
        raise ValueError(f"{OPTION} {dtype_label(dtype)} with --speculative-algorithm DFLASH: this SGLang hands the "
                         f"drafter bfloat16 embeddings (the plugin's hook on {EMBEDS_HOOK} did not apply); "
                         f"allowed: ['bfloat16'] (or 'auto' for a bfloat16 checkpoint)")
    return dtype


def drafter_launch_checks(result, server_args, *args, **_):
    """AFTER ``handle_speculative_decoding``: a DFLASH server's drafter runs in the target's dtype."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.plugins.hook_registry import HookRegistry

    cfg = resolving_view(server_args)
    if str(cfg.speculative_algorithm or "").upper() != "DFLASH":
        return result
    target = ModelConfig.from_server_args(server_args, model_path=cfg.model_path, model_revision=cfg.revision)
    check_dflash_dtype(target.dtype, EMBEDS_HOOK in HookRegistry._patched)
    return result
