"""TokenSwift drafting inside vLLM: a ``custom_class`` speculative proposer (options under
``additional_config["tokenswift"]``), one chain per request from the core's ``TokenSwiftDrafter`` (heads on the
target's captured hidden state, n-grams), verified by vLLM's rejection sampler; ``docs/tokenswift.md``.
"""
from __future__ import annotations

import torch

from dllm_core.drafters.tokenswift.config import DraftOptions
from dllm_core.drafters.tokenswift.drafter import TokenSwiftDrafter, row_at

KEY = "tokenswift"


def parse_options(additional_config) -> tuple[str | None, DraftOptions]:
    """``additional_config["tokenswift"]`` -> (heads directory or None, the core's drafting options)."""
    raw = (additional_config or {}).get(KEY) or {}
    opts = DraftOptions.from_mapping(raw, f"--additional-config {KEY}", host_keys=("heads",))
    return raw.get("heads"), opts


class TokenSwiftProposer:
    """vLLM ``custom_class`` proposer: TokenSwift heads on captured hidden states + n-gram reuse."""

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.k = self.num_speculative_tokens = int(spec.num_speculative_tokens)  # the latter: this step's (adaptive)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.hidden_size = int(vllm_config.model_config.get_hidden_size())
        self.heads_dir, self.opts = parse_options(vllm_config.additional_config)
        from .spec import AdaptiveDrafts  # its chosen count is verified whole (its measured cost is that count's)

        self.pad = issubclass(vllm_config.scheduler_config.get_scheduler_cls(), AdaptiveDrafts)
        self.heads = None
        self.drafter = TokenSwiftDrafter(self.opts)
        self._captured: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.stats = {"proposals": 0, "from_heads": 0, "no_hidden": 0}

    # --- target hook ---------------------------------------------------------------------------------------
    def load_model(self, target_model) -> None:
        """Load the heads (on the target's device, in its dtype: the core's ``drafter_dtype``) and hook the target
        to capture its hidden states."""
        if self.heads_dir:
            from dllm_core.drafters.dtypes import drafter_dtype
            from dllm_core.drafters.tokenswift.heads import load_heads

            p = next(target_model.parameters())
            self.heads = load_heads(self.heads_dir, p.device, drafter_dtype(p.dtype, "--dtype"))
            if self.heads.cfg.hidden_size != self.hidden_size:
                raise ValueError(f"--additional-config {KEY}.heads: heads of hidden size "
                                 f"{self.heads.cfg.hidden_size} do not fit the target ({self.hidden_size})")
            target_model.register_forward_hook(self._capture, with_kwargs=True)
            self.drafter = TokenSwiftDrafter(self.opts, self.heads, target_model.compute_logits)

    def _capture(self, module, args, kwargs, output) -> None:
        """Keep the newest forward's hidden states [T, H], positions [T] and query_start_loc [R+1]."""
        from vllm.forward_context import get_forward_context, is_forward_context_available

        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if not isinstance(output, torch.Tensor) or positions is None or not is_forward_context_available():
            return
        meta = get_forward_context().attn_metadata
        if isinstance(meta, list):
            meta = meta[0] if meta else None
        qsl = next((m.query_start_loc for m in (meta or {}).values() if hasattr(m, "query_start_loc")), None)
        if qsl is None:
            return
        self._captured = (output.detach(), positions.detach().flatten(), qsl.detach().to("cpu"))

    # --- drafting ------------------------------------------------------------------------------------------
    def _draft(self, row: int, tokens, k: int) -> list[int]:
        h0 = None
        if self.heads is not None:
            h0 = None if self._captured is None else row_at(*self._captured, row, len(tokens) - 2)  # -> token n-1
            self.stats["no_hidden" if h0 is None else "from_heads"] += 1
        return self.drafter.chain(row, tokens, k, h0)

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None,
                **_) -> list[list[int]]:
        """One draft chain (<= num_speculative_tokens) per request row; [] where nothing is proposed."""
        out: list[list[int]] = []
        for row, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[row])
            k = min(self.k, self.num_speculative_tokens, self.max_model_len - n)
            if not len(sampled) or k <= 0 or n < 2:
                out.append([])
                continue
            draft = self._draft(row, token_ids_cpu[row, :n], k)
            if self.pad:  # a shorter chain padded by its last token (verified as any draft: lossless)
                draft += [draft[-1] if draft else int(token_ids_cpu[row, n - 1])] * (k - len(draft))
            self.stats["proposals"] += bool(draft)
            out.append(draft)
        return out
