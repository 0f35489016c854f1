"""TokenSwift drafting inside vLLM: a ``custom_class`` speculative proposer (V1 model runner).

    LLM(model=TARGET_DIR, speculative_config={
            "method": "custom_class", "num_speculative_tokens": 3,
            "model": "integrations.vllm.tokenswift_proposer.TokenSwiftProposer"},
        additional_config={"tokenswift": {"heads": HEADS_DIR, "ngram_n": 4, "ngram_topk": 8}})

vLLM builds ``TokenSwiftProposer(vllm_config)``, hands it the loaded target in ``load_model(target_model)`` and,
after every step's bookkeeping, calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
slot_mappings=...)`` for one draft chain per request (its rejection sampler verifies chains, so the output is
the target's own - greedy output identical to decoding without drafts).

Drafts per request (n = tokens so far, the newest one sampled by the target):
- heads: a forward hook on the target captures the final hidden states of every forward together with their
  positions and vLLM's per-request ``query_start_loc``; the row at position n-2 is the hidden state that
  produced the newest token, i.e. TokenSwift's h0. The gamma chained residual heads
  (``dllm_core.drafters.tokenswift.heads``) run on it and the target's own ``compute_logits`` (its LM head)
  turns h_1..h_gamma into the next gamma tokens;
- token reutilization: ``dllm_core``'s ``NGramTable`` of the request's tokens (kept per batch row, rebuilt
  when the row holds another request), top-k n-grams keyed on the newest token.
The chain is the most frequent retrieved n-gram that agrees with the heads' first token, else the heads'
chain (without heads: the most frequent n-gram). vLLM verifies one chain per request, not a tree.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from dllm_core.drafters.tokenswift.ngram import NGramTable

KEY = "tokenswift"


@dataclass(frozen=True)
class TokenSwiftVllmOptions:
    """``additional_config["tokenswift"]``: ``heads`` (directory from ``dllm train-tokenswift``; None = n-gram
    reuse only), ``ngram_n``, ``ngram_topk`` (n-grams looked at per step), ``use_ngrams``."""

    heads: str | None = None
    ngram_n: int = 4
    ngram_topk: int = 8
    use_ngrams: bool = True

    def __post_init__(self):
        if self.ngram_n < 2:
            raise ValueError(f"--additional-config {KEY}.ngram_n must be >= 2, got {self.ngram_n}")
        if self.ngram_topk < 0:
            raise ValueError(f"--additional-config {KEY}.ngram_topk must be >= 0, got {self.ngram_topk}")

    @classmethod
    def from_additional_config(cls, additional_config) -> "TokenSwiftVllmOptions":
        raw = (additional_config or {}).get(KEY) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"--additional-config {KEY} must be an object, got {raw!r}")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - allowed)
        if unknown:
            raise ValueError(f"--additional-config {KEY}: unknown option(s) {unknown}; allowed: {sorted(allowed)}")
        return cls(**raw)


@dataclass
class _RowTable:
    """The n-gram table of the request in one batch row, and what it has seen of it."""

    table: NGramTable
    head: tuple[int, ...]  # first tokens of the request (identify it, with the last token seen)
    seen: int
    last: int


class TokenSwiftProposer:
    """vLLM ``custom_class`` proposer: TokenSwift heads on captured hidden states + n-gram reuse."""

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.hidden_size = int(vllm_config.model_config.get_hidden_size())
        self.opts = TokenSwiftVllmOptions.from_additional_config(vllm_config.additional_config)
        self.rows: dict[int, _RowTable] = {}
        self.heads = None
        self.target = None
        self._captured: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.stats = {"proposals": 0, "from_heads": 0, "from_ngrams": 0, "no_hidden": 0}

    # --- target hook ---------------------------------------------------------------------------------------
    def load_model(self, target_model) -> None:
        """Load the heads (dtype/device of the target) and hook the target to capture its hidden states."""
        self.target = target_model
        if self.opts.heads:
            from dllm_core.drafters.tokenswift.heads import load_heads

            p = next(target_model.parameters())
            self.heads = load_heads(self.opts.heads, p.device, p.dtype)
            if self.heads.cfg.hidden_size != self.hidden_size:
                raise ValueError(f"--additional-config {KEY}.heads: heads of hidden size "
                                 f"{self.heads.cfg.hidden_size} do not fit the target ({self.hidden_size})")
            target_model.register_forward_hook(self._capture, with_kwargs=True)

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

    def _h0(self, row: int, n: int) -> torch.Tensor | None:
        """Hidden state of the newest forward at position n-2 of batch row ``row`` (it produced token n-1)."""
        if self._captured is None:
            return None
        hidden, positions, qsl = self._captured
        if row + 1 >= qsl.numel():
            return None
        lo, hi = int(qsl[row]), int(qsl[row + 1])
        if hi <= lo:
            return None
        i = lo + (n - 2) - int(positions[lo])
        if not lo <= i < hi or int(positions[i]) != n - 2:
            return None
        return hidden[i]

    # --- drafting ------------------------------------------------------------------------------------------
    def _table(self, row: int, tokens: np.ndarray) -> NGramTable:
        n = len(tokens)
        head = tuple(int(t) for t in tokens[:16])
        st = self.rows.get(row)
        if st is None or st.head != head[: len(st.head)] or n < st.seen or (
                st.seen and int(tokens[st.seen - 1]) != st.last):
            st = _RowTable(NGramTable(self.opts.ngram_n), head, 0, -1)
            self.rows[row] = st
        if n > st.seen:
            st.table.update([int(t) for t in tokens[st.seen:n]])
            st.seen, st.head, st.last = n, head, int(tokens[n - 1])
        return st.table

    @torch.inference_mode()
    def _heads_chain(self, h0: torch.Tensor) -> list[int]:
        levels = self.target.compute_logits(self.heads(h0[None])[0, 1:])  # [gamma, V]: l_1 .. l_gamma
        return levels.argmax(-1).tolist()

    def _draft(self, row: int, tokens: np.ndarray, k: int) -> list[int]:
        n = len(tokens)
        grams = []
        if self.opts.use_ngrams and self.opts.ngram_topk:
            grams = self._table(row, tokens).top(int(tokens[-1]), self.opts.ngram_topk)
        chain: list[int] = []
        if self.heads is not None:
            h0 = self._h0(row, n)
            if h0 is None:
                self.stats["no_hidden"] += 1
            else:
                chain = self._heads_chain(h0)
        if chain:
            agree = next((g for g in grams if g[0] == chain[0]), None)
            if agree is not None:
                self.stats["from_ngrams"] += 1
                return list(agree[:k])
            self.stats["from_heads"] += 1
            return chain[:k]
        if grams:
            self.stats["from_ngrams"] += 1
            return list(grams[0][:k])
        return []

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None,
                **_) -> list[list[int]]:
        """One draft chain (<= num_speculative_tokens) per request row; [] where nothing is proposed."""
        out: list[list[int]] = []
        for row, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[row])
            k = min(self.k, self.max_model_len - n)
            if not len(sampled) or k <= 0 or n < 2:
                out.append([])
                continue
            draft = self._draft(row, token_ids_cpu[row, :n], k)
            self.stats["proposals"] += bool(draft)
            out.append(draft)
        return out
