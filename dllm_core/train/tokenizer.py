"""The task-suite tokenizer: byte-level BPE with single-digit tokens and LLaDA's special / chat tokens,
trained locally on task text (no download)."""
from __future__ import annotations

import random
import re
from pathlib import Path

from ..tasks import make_task
from ..testing import build_tokenizer

VOCAB_SIZE = 512
# The BPE corpus, pinned: task specs and example counts (the word problems get most merges, random
# retrieval keys few). Pinned specs keep the vocabulary - and so every trained checkpoint - valid
# when a task's default difficulty changes.
CORPUS_MIX = {"arithmetic": ("arithmetic:hi=40,max_operand=15,max_total=99", 2000), "count": ("count", 5),
              "retrieval": ("retrieval", 5), "sort": ("sort:max_len=10", 50)}
# Texts as they read when the shipped vocabulary was built (a task's later wording must not change it).
PINNED_WORDING = {"retrieval": lambda p: re.sub(r"What is the value of this key\?\n(\w+):$", r"What is the value of \1?",
                                                p)}


def task_corpus(seed: int = 0) -> list[str]:
    """Chat roles plus prompts and responses of training examples of every task (``CORPUS_MIX``)."""
    rng, texts = random.Random(seed), ["user", "assistant"] * 100
    for name in sorted(CORPUS_MIX):
        spec, n = CORPUS_MIX[name]
        task = make_task(spec)
        for _ in range(n):
            ex = task.sample(rng, "train")
            texts += [PINNED_WORDING.get(name, str)(ex.prompt), ex.response[:400]]
    return texts


def build_task_tokenizer(out_dir: str | Path, vocab_size: int = VOCAB_SIZE, seed: int = 0) -> dict[str, int]:
    """Write tokenizer.json + tokenizer_config.json (LLaDA chat template, EOS = pad) to ``out_dir``;
    return the special-token ids and ``vocab_size``."""
    return build_tokenizer(out_dir, "llada", task_corpus(seed=seed), vocab_size=vocab_size, split_digits=True)
