"""``dllm train-mdm``: SFT-style masked-diffusion training of a small LLaDA-architecture model.

Per example the prompt stays clean; every response token (answer, EOT and the EOS padding up to the
task's gen_length, as in LLaDA's SFT) is masked with probability t ~ U(eps, 1), and the loss is the
cross entropy on masked tokens weighted by 1/t, averaged over response tokens (LLaDA eq. 5). By
default the t of a batch's rows are drawn low-discrepancy (``--t-sampling stratified``: one uniform
offset + evenly spaced, each still U(eps, 1)); ``iid`` draws them independently.

``--block-noise F`` noises a fraction F of the rows as the semi-autoregressive decoder meets them
(Blockwise SFT, Sun et al. 2025): one block of the task's ``block_length`` is drawn among those the
answer reaches, the blocks before it stay clean, it is masked with probability t and scored, and every
block after it is masked whole (unscored), so that the model trains on the states the vanilla loop
decodes: a clean prefix, a partly decoded block, a masked future.

``--suffix-noise F`` masks the scored block of a fraction F of those rows from a uniform cut point to its end
instead of token by token: the state of a decoder that commits left to right (the confidence order of a
counting or worked answer). Token-wise masking nearly always leaves an EOS of the padding visible a few
tokens past the answer's end, so the end can be read off the canvas; right of a cut nothing is visible, and
the end (EOT after the last number, ``####`` after the last day) must be read from the prompt.

``--end-noise F`` makes a fraction F of the block rows draw the block holding the answer's end (its EOT) instead
of a uniform one: on a long answer the middle blocks are easy (the next number follows from the last) and the
one decision that fails is where to stop. ``--creep-noise F`` masks the scored block of a fraction F of the block
rows (disjoint from the suffix rows) from its start to a uniform cut, the tokens right of the cut visible: the
state of the vanilla decoder in an answer's last block, which commits the padding at the block's right end
first (it is certain there) and then creeps left, so where the padding must stop has to be read from the clean
prefix and the prompt.

``--edit-noise R`` adds LLaDA2.1's token-to-token objective (what its token editing needs): a fraction R of the
visible response tokens is replaced by other tokens of the same response and every visible token is scored, so
the model learns to restore a wrong committed token and to keep a right one.

``--arch llada2`` trains a ``LLaDA2MoeModelLM`` (block-causal MoE): its attention is block-causal on the
absolute position grid (``--block-size``), ``--block-noise`` blocks are grid blocks, the response is padded
by one more block (inference decodes the answer's last grid block whole), and the routers' expert biases
follow LLaDA2's aux-loss-free balancing (after each step, ``--balance`` times the sign of each expert's
load below the mean; the bias only steers the choice, never the weights).

``--arch dream`` trains a ``DreamModel`` (Qwen2 key names, QKV biases) on the same data with Dream's
shifted logits: the token at position i is predicted by the logit row i - 1 (the first response token by
the last prompt row), as the engine decodes it (``model.shift_logits``). ``--init`` may then name a LLaDA
checkpoint of the same sizes: its weights are mapped into the Dream model (QKV biases zero)."""
from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

from ..engine.generate import block_causal_mask
from ..models import DiffusionLM, DreamModel, LLaDA2MoeModelLM, LLaDAModelLM, load_model, save_model
from ..testing import llada2_config, llada_config
from .common import add_train_args, dtype_of, eval_fn, init_from, setup, step_generator, train_config
from .config import MDM_ARCHS, MDMTrainConfig
from .data import ChatEncoder, draw, mdm_batch, stream_keys
from .loop import train

EPS = 1e-3
DEFAULTS = MDMTrainConfig(out="models/llada-tasks")


def noise_levels(B: int, gen: torch.Generator, device, stratified: bool = True) -> torch.Tensor:
    """t ~ U(eps, 1) per row, [B, 1]; ``stratified``: one uniform offset with the rows spread evenly
    over [0, 1) (low-discrepancy: each t is still uniform, the batch's loss has lower variance)."""
    if stratified:
        u = (torch.rand(1, generator=gen, device=device) + torch.arange(B, device=device) / B) % 1
    else:
        u = torch.rand(B, generator=gen, device=device)
    return ((1 - EPS) * u + EPS)[:, None]


def block_rows(B: int, T: int, P: int, x: torch.Tensor, frac: float, block: int, pad_id: int,
               gen: torch.Generator, pos: torch.Tensor | None = None,
               end: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blockwise-SFT rows (``--block-noise``): -> rows [B, 1], active block [B, T], masked future [B, T].
    A row's block is uniform over those that start at or before its first padding token (the block
    where the answer ends, or the one after, holds the EOT/EOS the model must learn to write); an ``end``
    fraction of the rows (``--end-noise``) takes the block holding the EOT. Blocks start at the response (P)
    or, with ``pos`` [B, T] (block-causal models), lie on the position grid."""
    rows = torch.rand(B, 1, generator=gen, device=x.device) < frac  # [B, 1]
    n = (x[:, P:] != pad_id).sum(1)  # [B] answer + EOT (no padding inside the answer)
    col = torch.arange(T, device=x.device)[None]  # [1, T]
    idx = ((col - P) // block).expand(B, -1) if pos is None else pos // block - pos[:, P:P + 1] // block  # [B, T]
    last = idx.gather(1, (P + n).clamp(max=T - 1)[:, None])[:, 0]  # [B] block of the first padding token
    reach = torch.clamp(last + 1, max=int(idx[:, -1].min()) + 1)  # [B] blocks a row may draw
    k = (torch.rand(B, generator=gen, device=x.device) * reach).long()[:, None]  # [B, 1]
    if end > 0:
        eot = idx.gather(1, (P + n - 1).clamp(P, T - 1)[:, None])  # [B, 1] block of the answer's last token
        k = torch.where(torch.rand(B, 1, generator=gen, device=x.device) < end, eot, k)
    resp = col >= P
    return rows, resp & (idx == k), resp & (idx > k)


def cut_rows(rows: torch.Tensor, active: torch.Tensor, suffix: float, creep: float,
             gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``--suffix-noise`` / ``--creep-noise``: of the block rows [B, 1], a ``suffix`` fraction masked from a uniform
    cut point to the block's end and a disjoint ``creep`` fraction from the block's start to a uniform cut (at
    least one token, at most the whole block each) -> (those rows [B, 1], their masked tokens [B, T])."""
    B = rows.shape[0]
    r = torch.rand(B, 1, generator=gen, device=rows.device)  # [B, 1]
    sfx, crp = rows & (r < suffix), rows & (r >= suffix) & (r < suffix + creep)  # [B, 1]
    n = active.sum(1, keepdim=True)  # [B, 1] tokens of the active block
    cut = (torch.rand(B, 1, generator=gen, device=rows.device) * n).long()  # [B, 1] in [0, n)
    rank = active.cumsum(1)  # [B, T] 1-based rank inside the active block
    masked = torch.where(sfx, active & (rank > cut), active & (rank <= n - cut))  # [B, T]
    return sfx | crp, masked & (sfx | crp)


def mdm_loss(model: DiffusionLM, x: torch.Tensor, keep: torch.Tensor, pos: torch.Tensor, P: int, mask_id: int,
             gen: torch.Generator, stratified: bool = True, prompt_noise: float = 0.0, block_noise: float = 0.0,
             block: int = 32, pad_id: int = 1, edit_noise: float = 0.0, suffix_noise: float = 0.0,
             end_noise: float = 0.0, creep_noise: float = 0.0) -> torch.Tensor:
    """x [B, T] clean canvas (response = x[:, P:]), keep [B, 1, 1, T] key mask -> scalar loss.

    SFT rows noise the response only; a ``prompt_noise`` fraction of rows (drawn per row) is noised
    whole, prompt included (LLaDA's pre-training loss). Each row's loss is normalised by the number of
    tokens it may noise: G for SFT rows (LLaDA eq. 5), its unpadded length for whole-noised rows. A
    ``block_noise`` fraction of the other rows is noised block-wise (``block_rows``; ``pad_id`` ends an
    answer; an ``end_noise`` fraction of them at the answer's end), scored on its active block and normalised by
    the block's length; a ``suffix_noise`` fraction of those masks the block from a uniform cut on and a
    ``creep_noise`` fraction up to a uniform cut (``cut_rows``), weighted by 1 / the masked fraction.

    ``edit_noise`` > 0 adds LLaDA2.1's token-to-token term: of the noisable tokens left visible, a fraction is
    replaced by the token of a random response position of the same row (a plausible error, as a decoder
    commits them), and every visible noisable token is scored (restore the replaced, keep the others),
    unweighted, over the same normaliser.

    A model with ``shift_logits`` (Dream) predicts position i from the logit row i - 1, as the engine
    decodes: the first response token from the last prompt row; a token whose previous position is
    padding (the first of a whole-noised row) has no row predicting it and is never noised."""
    B, T = x.shape
    s = int(model.shift_logits)
    bc = model.block_causal
    attn = block_causal_mask(keep[:, 0, 0], pos, bc) if bc else keep
    t = noise_levels(B, gen, x.device, stratified)  # [B, 1]
    whole = torch.rand(B, 1, generator=gen, device=x.device) < prompt_noise  # [B, 1]
    col = torch.arange(T, device=x.device)[None]  # [1, T]
    noisable = keep[:, 0, 0] & ((col >= P) | whole)  # [B, T]
    if s:
        noisable = noisable & F.pad(keep[:, 0, 0, :-1], (1, 0), value=False)  # the row before is a real token
    masked = (torch.rand(B, T, generator=gen, device=x.device) < t) & noisable  # [B, T]
    scored = masked
    if block_noise > 0:
        rows, active, future = block_rows(B, T, P, x, block_noise, bc or block, pad_id, gen, pos if bc else None,
                                          end_noise)
        rows = rows & ~whole
        noisable = torch.where(rows, noisable & active, noisable)
        scored = torch.where(rows, masked & active, masked)
        if suffix_noise > 0 or creep_noise > 0:
            part, cut = cut_rows(rows, active, suffix_noise, creep_noise, gen)  # rows masked up to / from a cut
            scored = torch.where(part, cut, scored)
            t = torch.where(part, cut.sum(1, keepdim=True) / active.sum(1, keepdim=True).clamp_min(1), t)
        masked = torch.where(rows, scored | (future & keep[:, 0, 0]), masked)
    first = max(0 if prompt_noise > 0 else P, s)  # first position whose prediction is needed
    inp, seen = x.masked_fill(masked, mask_id), noisable & ~masked  # [B, T]
    if edit_noise > 0:
        swap = (torch.rand(B, T, generator=gen, device=x.device) < edit_noise) & seen
        src = torch.randint(P, T, (B, T), generator=gen, device=x.device)
        inp = torch.where(swap, x.gather(1, src), inp)
    h, rope = model.embed(inp), model.rope(pos)
    for layer in model.layers:
        h = layer(h, rope, attn)
    logits = model.logits(h[:, first - s:T - s])  # [B, T - first, V]: row j predicts position first + j
    ce = F.cross_entropy(logits.flatten(0, 1), x[:, first:].flatten(), reduction="none").view(B, -1)
    per_row = (ce * scored[:, first:] / t).sum(1) / noisable.sum(1)  # [B]
    if edit_noise > 0:
        per_row = per_row + (ce * seen[:, first:]).sum(1) / noisable.sum(1)
    return per_row.mean()


def dream_config(ids: dict, dim: int, n_layers: int, n_heads: int, n_kv_heads: int | None, ffn: int,
                 max_len: int) -> dict:
    """A Dream (Qwen2-style) config.json for the task tokenizer (``ids``: its raw special ids + vocab size).
    RoPE theta and RMSNorm eps are LLaDA's (``llada_config``), so that a LLaDA checkpoint maps over exactly."""
    v = -(-ids["vocab_size"] // 64) * 64
    eos = ids["<|endoftext|>"]
    return {"architectures": ["DreamModel"], "model_type": "Dream", "hidden_size": dim,
            "num_hidden_layers": n_layers, "num_attention_heads": n_heads,
            "num_key_value_heads": n_kv_heads or n_heads, "intermediate_size": ffn, "vocab_size": v,
            "max_position_embeddings": max_len, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu",
            "tie_word_embeddings": False, "use_sliding_window": False, "mask_token_id": ids["<|mdm_mask|>"],
            "bos_token_id": ids["<|startoftext|>"], "eos_token_id": eos, "pad_token_id": eos,
            "torch_dtype": "float32"}


def balance_experts(model: DiffusionLM, rate: float) -> None:
    """LLaDA2's aux-loss-free load balancing: each MoE router's expert bias moves by ``rate`` towards
    the experts that received fewer than the mean number of tokens in the last forward (its ``load``)."""
    with torch.no_grad():
        for layer in model.layers:
            moe = getattr(layer, "mlp", None)
            if getattr(moe, "load", None) is not None and moe.expert_bias is not None:
                moe.expert_bias += rate * torch.sign(moe.load.mean() - moe.load)
                moe.load = None


def init_state(model: DiffusionLM, cfg: MDMTrainConfig) -> dict[str, torch.Tensor]:
    """The ``--init`` checkpoint's weights for ``model``; a LLaDA checkpoint into a Dream model gets zero
    QKV biases (LLaDA has none), so the Dream model starts computing exactly LLaDA's hidden states."""
    src = load_model(cfg.init, cfg.device)
    state = src.state_dict()
    if model.args.qkv_bias and not src.args.qkv_bias:
        state.update({k: torch.zeros_like(v) for k, v in model.state_dict().items()
                      if k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))})
    return state


def build(cfg: MDMTrainConfig, ids: dict) -> tuple[DiffusionLM, dict]:
    """Fresh LLaDA / Dream / LLaDA2 model (``cfg.arch``) + its config.json dict, small-std init (zero biases)."""
    sizes = dict(dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                 ffn=cfg.ffn, max_len=cfg.max_len)
    cls = {"llada": LLaDAModelLM, "dream": DreamModel, "llada2": LLaDA2MoeModelLM}[cfg.arch]
    if cfg.arch == "llada2":
        groups = 2 if cfg.experts % 2 == 0 and cfg.experts >= 4 else 1  # grouped routing, as LLaDA2-mini's
        kept = 1 if groups == 2 and cfg.experts // 2 >= cfg.top_k else groups  # one group when it holds top_k
        sizes.update(head_dim=cfg.dim // cfg.n_heads, experts=cfg.experts, top_k=cfg.top_k, moe_ffn=cfg.moe_ffn,
                     block_size=cfg.block_size, n_group=groups, topk_group=kept)
        sizes["n_kv_heads"] = sizes["n_kv_heads"] or cfg.n_heads
        hf = llada2_config(ids["raw"], **sizes)
    else:
        hf = (llada_config if cfg.arch == "llada" else dream_config)(ids["raw"], **sizes)
    model = cls(cls.parse_config(hf)).to(cfg.device)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.02)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(p)
    if cfg.init:
        init_from(model, cfg, init_state(model, cfg))
    return model, hf


def cmd_train_mdm(a) -> int:
    from ..tasks.evaluate import run_mdm, task_config

    cfg = MDMTrainConfig(**asdict(train_config(a)), arch=a.arch, experts=a.experts, top_k=a.top_k,
                         moe_ffn=a.moe_ffn, block_size=a.block_size, balance=a.balance)
    tok, ids = setup(cfg)
    model, hf = build(cfg, ids)
    tasks, sizes, enc = cfg.task_list(), cfg.batch_sizes, ChatEncoder(tok, ids["eot"])
    extra = model.block_causal  # block-causal: room for each answer's last grid block, decoded whole

    def loss_fn(step: int, micro: int = 0):
        if cfg.balance:
            balance_experts(model, cfg.balance)  # the previous step's loads (its backward is done)
        gen, total, n = step_generator(cfg, step), 0.0, 0
        for task, b, key in zip(tasks, sizes, stream_keys(tasks)):
            x, keep, pos, P = mdm_batch(enc, task, draw(task, b, cfg.seed, step, key), ids, cfg.device, extra)
            loss = mdm_loss(model, x, keep, pos, P, ids["mask"], gen, cfg.t_sampling == "stratified",
                            cfg.prompt_noise, cfg.block_noise, task.block_length, ids["eos"], cfg.edit_noise,
                            cfg.suffix_noise, cfg.end_noise, cfg.creep_noise)
            total = total + loss
            n += x.numel()
        return total / len(tasks), n

    evaluate = eval_fn(cfg, lambda t, exs: run_mdm(model, tok, t, exs, task_config(t), batch_size=16))
    t0 = time.perf_counter()
    summary = train(cfg, model, loss_fn, evaluate, desc="train-mdm")
    hf["torch_dtype"] = cfg.save_dtype
    save_model(copy.deepcopy(model).to(dtype_of(cfg)), cfg.out, hf)
    print(json.dumps({**summary, "wall_seconds": time.perf_counter() - t0, "out": cfg.out}))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("train-mdm", help="train a small LLaDA- or Dream-architecture masked-diffusion model on the "
                                         "task suite")
    add_train_args(p, DEFAULTS)
    p.add_argument("--arch", default=DEFAULTS.arch,
                   help=f"one of {list(MDM_ARCHS)}: LLaDAModelLM, DreamModel (QKV biases, logits shifted by one "
                        f"position; --init may map a LLaDA checkpoint into it) or LLaDA2MoeModelLM (block-causal MoE)")
    for flag, kind in (("experts", int), ("top_k", int), ("moe_ffn", int), ("block_size", int), ("balance", float)):
        p.add_argument("--" + flag.replace("_", "-"), type=kind, default=getattr(DEFAULTS, flag),
                       help=f"--arch llada2 only (default {getattr(DEFAULTS, flag)})")
    p.set_defaults(func=cmd_train_mdm)
