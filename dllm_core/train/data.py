"""Turn task examples into training batches: per-step deterministic draws (resumable by step)."""
from __future__ import annotations

import random

import torch

from ..engine import GenerationConfig, build_canvas
from ..tasks import Example, Task
from ..tokenizer import encode_prompt


def encode(tok, ex: Example, eot_id: int) -> tuple[list[int], list[int]]:
    """(prompt ids with the chat template, response ids + EOT)."""
    prompt = encode_prompt(tok, ex.prompt, chat=True, turns=ex.turns)
    return prompt, tok(ex.response, add_special_tokens=False)["input_ids"] + [eot_id]


class ChatEncoder:
    """``encode`` for a whole batch in one tokenizer call: the chat template is rendered once into
    the ids around the user text (``encode_prompt`` renders Jinja per prompt, the slowest part of a
    training step). Checks itself against ``encode`` on the first example of every batch."""

    def __init__(self, tok, eot_id: int):
        self.tok, self.eot = tok, eot_id
        probe = "Probe"
        full = encode_prompt(tok, probe, chat=True)
        body = tok(probe, add_special_tokens=False)["input_ids"]
        at = next(i for i in range(len(full)) if full[i:i + len(body)] == body)
        self.head, self.tail = full[:at], full[at + len(body):]

    def __call__(self, examples: list[Example]) -> list[tuple[list[int], list[int]]]:
        if any(e.turns for e in examples):  # multi-turn prompts: the template per example
            return [encode(self.tok, e, self.eot) for e in examples]
        texts = [e.prompt for e in examples] + [e.response for e in examples]
        ids = self.tok(texts, add_special_tokens=False)["input_ids"]
        n = len(examples)
        out = [(self.head + p + self.tail, r + [self.eot]) for p, r in zip(ids[:n], ids[n:])]
        if out and out[0] != encode(self.tok, examples[0], self.eot):
            raise RuntimeError("ChatEncoder: batched chat encoding differs from encode_prompt")
        return out


def stream_keys(tasks: list[Task]) -> list[str]:
    """One name per task of a mixture: its name, or its spec string when an earlier task has the same name
    (``count:span=48;count:span=100`` -> ``count``, ``count:span=100``), so no two draw the same stream."""
    seen: set[str] = set()
    out = []
    for t in tasks:
        out.append(t.label if t.name in seen else t.name)
        seen.add(t.name)
    return out


def step_rng(seed: int, step: int, key: str) -> random.Random:
    """The data stream of one task (``stream_keys``) at one step; depends on nothing else, so resuming is exact."""
    return random.Random(f"{seed}:{step}:{key}")


def draw(task: Task, n: int, seed: int, step: int, key: str | None = None) -> list[Example]:
    rng = step_rng(seed, step, key or task.name)
    return [task.sample(rng, "train") for _ in range(n)]


def mdm_batch(enc_fn: ChatEncoder, task: Task, examples: list[Example], ids: dict, device, extra: int = 0):
    """Left-padded [prompt | response + EOT + EOS padding to ``task.gen_length`` (+ ``extra``)], the layout
    the engine decodes in. -> x [B, T], key mask [B, 1, 1, T], positions [B, T], prompt length P."""
    G = task.gen_length
    enc = enc_fn(examples)
    too_long = [len(r) for _, r in enc if len(r) > G]
    if too_long:
        raise ValueError(f"task {task.name}: responses of {max(too_long)} tokens exceed its gen_length {G}")
    G += extra
    cfg = GenerationConfig(gen_length=G, block_length=G, steps=G)
    x, keep, pos, P = build_canvas([p for p, _ in enc], cfg, ids["mask"], ids["eos"], device)
    resp = torch.tensor([r + [ids["eos"]] * (G - len(r)) for _, r in enc], device=device)  # [B, G]
    x[:, P:] = resp
    return x, keep, pos, P


def ar_batch(enc_fn: ChatEncoder, examples: list[Example], ids: dict, device):
    """Right-padded prompt + response + EOT. -> input ids [B, T], attention mask [B, T],
    labels [B, T] (-100 on prompt and padding)."""
    enc = enc_fn(examples)
    T = max(len(p) + len(r) for p, r in enc)
    x = torch.full((len(enc), T), ids["eos"], dtype=torch.long)
    att = torch.zeros_like(x)
    lab = torch.full_like(x, -100)
    for i, (p, r) in enumerate(enc):
        n = len(p) + len(r)
        x[i, :n] = torch.tensor(p + r)
        att[i, :n] = 1
        lab[i, len(p):n] = torch.tensor(r)
    return x.to(device), att.to(device), lab.to(device)
