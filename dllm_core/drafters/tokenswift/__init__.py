"""TokenSwift (2025): lossless acceleration of ultra-long generation for causal targets.

gamma chained residual heads on the target's last hidden state (``heads.py``), n-gram reuse (``ngram.py``),
a draft-side dynamic KV cache next to the full verification cache (``kvcache.py``), the windowed contextual
penalty (``penalty.py``), one drafter for every host (``drafter.py``), tree candidates verified in one target forward (``tree.py`` on top of the shared
``drafters/verify.py``), the decoding loop and its AR baseline (``generate.py``), ``dllm train-tokenswift``
(``train.py``) and ``dllm bench-long`` (``bench.py``).
"""
from .config import DRAFTS, DraftOptions, TokenSwiftConfig
from .drafter import RequestDrafter, TokenSwiftDrafter
from .generate import LongResult, autoregressive_generate, tokenswift_generate
from .heads import HeadsConfig, TokenSwiftHeads, load_heads, save_heads
from .kvcache import DynamicDraftCache, KVCache, group_scores
from .ngram import NGramTable
from .penalty import ContextualPenalty
from .tree import Tree, accept_tree, build_tree, main_branch, padded, tree_attention_mask

__all__ = ["DRAFTS", "ContextualPenalty", "DraftOptions", "DynamicDraftCache", "HeadsConfig", "KVCache", "LongResult", "NGramTable",
           "RequestDrafter", "TokenSwiftConfig", "TokenSwiftDrafter", "TokenSwiftHeads", "Tree", "accept_tree", "autoregressive_generate", "build_tree",
           "group_scores", "load_heads", "main_branch", "padded", "save_heads", "tokenswift_generate",
           "tree_attention_mask"]
