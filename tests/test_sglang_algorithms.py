"""The dllm_core samplers as SGLang dLLM algorithms, driven by SGLang's real ``DllmAlgorithm.run``
loops (synchronous and FDFO) on CPU tensors shaped like SGLang's ``ForwardBatch``.

* vs the reference engine: a scripted network whose logits are a function of the visible
  non-mask tokens gives both engines the same logits for the same canvas; prompts that fill
  whole blocks make SGLang's block layout equal the reference's, so ``generate`` is the oracle.
* prompt offsets inside the block (SGLang's first block holds the prompt tail, incl. a literal
  mask id under ``dllm_prompt_mask``): per-request random logit sequences, and the reference
  engine's per-block protocol (``begin_block`` / ``active`` / ``window`` / ``step``) as oracle.
* peer parity: ``FastDllmThreshold`` commits exactly what SGLang's own ``LowConfidence`` commits.
"""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.dllm.algorithm")

from dllm_core.engine import GenerationConfig, generate  # noqa: E402
from dllm_core.sampling import TokenContext, make_sampler  # noqa: E402
from integrations.sglang.algorithm import DllmCore, FastDllmFactor, FastDllmThreshold, SlowFast  # noqa: E402
from sglang_cpu import BlockDriver, CpuRunner  # noqa: E402
from sglang.srt.dllm.algorithm.low_confidence import LowConfidence  # noqa: E402
from sglang.srt.dllm.config import DllmConfig  # noqa: E402

V, MASK, L, R, K = 64, 63, 8, 211, 7
_g = torch.Generator().manual_seed(0)
W = torch.randint(1, 50, (K,), generator=_g)  # position weights of the context hash
TABLE = (torch.randn(R, V, generator=_g) * 4).index_fill_(1, torch.tensor([MASK]), -1e9)  # never proposes [MASK]


def scripted_rows(tokens, pos, keep, qpos):
    """TABLE row per query: an exact integer hash of the visible non-mask tokens with their
    positions (order-free: padding and batching cannot change it) and the query position."""
    ctx = (tokens * W[pos % K] * (keep & (tokens != MASK))).sum(-1, keepdim=True)
    return (ctx * 7 + qpos * 13) % R


class _Embed:
    weight = torch.zeros(1)

    def __call__(self, x):
        return x


class ScriptedLM:
    """The scripted network as a dllm_core DiffusionLM, for ``generate`` (cache ``none``: one
    bidirectional pass over the whole left-padded canvas per step)."""

    shift_logits = False
    block_causal = 0
    embed = _Embed()
    args = SimpleNamespace(mask_token_id=MASK, max_seq_len=4096, pad_token_id=None, eos_token_id=None, n_layers=1)

    def rope(self, pos):
        return pos

    @property
    def layers(self):
        return [lambda x, pos, mask: scripted_rows(x, pos, torch.ones_like(x, dtype=torch.bool) if mask is None
                                                   else mask[:, 0, 0], pos)]

    def logits(self, h):
        return TABLE[h]


class ScriptedRunner(CpuRunner):
    """The same network on SGLang's side: a forward persists its block's tokens per request slot
    (the analogue of the block's K/V) and sees the slot's prefix + the block."""

    def __init__(self):
        super().__init__(None, max_len=256, max_reqs=8)
        self.tokens, self.calls = {}, {}

    def alloc_slot(self):
        slot = super().alloc_slot()
        self.tokens[slot], self.calls[slot] = torch.full((256,), MASK), 0
        return slot

    def forward(self, fb, pp_proxy_tensors=None):
        B = fb.batch_size
        ids, pos = fb.input_ids.view(B, L), fb.positions.view(B, L)
        rows = []
        for b in range(B):
            slot, s = int(fb.req_pool_indices[b]), int(pos[b, 0])
            self.tokens[slot][s:s + L] = ids[b]
            self.calls[slot] += 1
            seq = self.tokens[slot][:s + L]
            rows.append(TABLE[scripted_rows(seq, torch.arange(s + L), torch.ones_like(seq, dtype=torch.bool), pos[b])])
        return SimpleNamespace(logits_output=SimpleNamespace(full_logits=torch.cat(rows)), can_run_graph=False)


def algo(cls, cfg: dict, fdfo: bool):
    return cls(DllmConfig(cls.__name__, cfg, L, MASK, 8, first_done_first_out_mode=fdfo))


CASES = [(FastDllmThreshold, {"tau": 0.6}, "threshold:tau=0.6"),
         (FastDllmFactor, {"f": 1.5}, "factor:f=1.5"),
         (SlowFast, {}, "slowfast"),
         (SlowFast, {"min_conf": 0.3, "high": 0.9, "k": 3, "stat": "std"},
          "slowfast:min_conf=0.3,high=0.9,k=3,stat=std"),
         (DllmCore, {"sampler": "low_confidence", "steps": 12}, "low_confidence")]
IDS = [f"{c[0].__name__}-{c[2]}" for c in CASES]


@pytest.mark.parametrize("fdfo", [False, True], ids=["sync", "fdfo"])
@pytest.mark.parametrize("cls,cfg,spec", CASES, ids=IDS)
def test_matches_reference_engine(cls, cfg, spec, fdfo):
    """A batch of 1- and 2-block prompts (left-padded in the reference), 3 blocks generated."""
    prompts = [[3 + i for i in range(L)], [20 + (5 * i) % 40 for i in range(2 * L)], [9 + i for i in range(L)]]
    runner = ScriptedRunner()
    drv = BlockDriver(algo(cls, cfg, fdfo), runner)
    out = drv.generate(prompts, 3 * L, MASK)
    ref = generate(ScriptedLM(), prompts, GenerationConfig(gen_length=3 * L, block_length=L, steps=12, sampler=spec))
    assert out == ref.tokens.tolist()
    if fdfo:  # per request: prefill forwards + the reference's denoise steps + 1 persisting forward per block
        assert [runner.calls[r.slot] for r in drv.rows] == [len(p) // L + n + 3 for p, n in zip(prompts, ref.nfe)]


# ---- prompt offsets inside the block: random logits, the reference per-block protocol ---------
def reference_block(sampler, x: torch.Tensor, logits_of) -> list[torch.Tensor]:
    """``generate``'s inner loop over one block, x [B, L]: the block before every step + the end."""
    st = sampler.new_state(x.shape[0], L, L, x.device)
    sampler.begin_block(st, x == MASK)
    seen, n = [], 0
    while not sampler.block_done(st, masked := x == MASK):
        seen.append(x.clone())
        active = sampler.active(st, masked)
        lo, hi = sampler.window(st, active)
        x0, commit = sampler.step(logits_of(n)[:, lo:hi], x[:, lo:hi], st, TokenContext(MASK), lo)
        commit &= active[:, None]
        x[:, lo:hi] = torch.where(commit, x0, x[:, lo:hi])
        n += 1
    return seen + [x.clone()]


class RandomRunner(CpuRunner):
    """A request's n-th forward returns its n-th random logits; the block of every forward is kept."""

    def __init__(self, n_rows: int, seed: int):
        super().__init__(None, max_len=64, max_reqs=n_rows)
        self.seq = torch.randn(n_rows + 1, L + 2, L, V, generator=torch.Generator().manual_seed(seed)) * 3
        self.seq[..., MASK] = -1e9
        self.seen = {s: [] for s in range(n_rows + 1)}

    def forward(self, fb, pp_proxy_tensors=None):
        B, rows = fb.batch_size, []
        for b in range(B):
            slot = int(fb.req_pool_indices[b])
            self.seen[slot].append(fb.input_ids.view(B, L)[b].tolist())
            rows.append(self.seq[slot, len(self.seen[slot]) - 1])
        return SimpleNamespace(logits_output=SimpleNamespace(full_logits=torch.cat(rows)), can_run_graph=False)


OFFSET_PROMPTS = [[11, 12, 13], [21, 22, 23, 24, 25, 26], [31], [41, MASK, 43, 44]]  # the last: a literal mask id


def run_offsets(cls, cfg, fdfo, seed, prompts=OFFSET_PROMPTS):
    """One block per request (the one holding its prompt tail), SGLang side."""
    runner = RandomRunner(len(prompts), seed)
    drv = BlockDriver(algo(cls, cfg, fdfo), runner)
    out = drv.generate(prompts, 1, MASK, prompt_mask=True)
    return out, [runner.seen[r.slot] for r in drv.rows], [r.slot for r in drv.rows], runner


@pytest.mark.parametrize("fdfo", [False, True], ids=["sync", "fdfo"])
@pytest.mark.parametrize("cls,cfg,spec", CASES[:4], ids=IDS[:4])
def test_prompt_offsets_inside_block(cls, cfg, spec, fdfo):
    _, seen, slots, runner = run_offsets(cls, cfg, fdfo, seed=1)
    # the oracle sees the literal mask as the prompt token it is (any non-mask id)
    x = torch.tensor([[t if t != MASK else 0 for t in p] + [MASK] * (L - len(p)) for p in OFFSET_PROMPTS])
    steps = reference_block(make_sampler(spec), x, lambda n: runner.seq[slots, n])
    steps = [s.masked_fill(torch.tensor([[t == MASK for t in p] + [False] * (L - len(p)) for p in OFFSET_PROMPTS]),
                           MASK) for s in steps]
    assert len(steps) > 3
    for b, got in enumerate(seen):  # forward n of request b saw the reference's block before step n
        want = [s[b].tolist() for s in steps]
        done = next(n for n, w in enumerate(want) if MASK not in w[len(OFFSET_PROMPTS[b]):])
        if fdfo:  # the request leaves after the forward that persists its finished block
            assert len(got) == done + 1
        assert got == [want[min(n, len(want) - 1)] for n in range(len(got))]
        assert got[-1][:len(OFFSET_PROMPTS[b])] == OFFSET_PROMPTS[b]  # prompt (and its literal mask) untouched


@pytest.mark.parametrize("fdfo", [False, True], ids=["sync", "fdfo"])
@pytest.mark.parametrize("tau", [0.3, 0.9, 0.999])
def test_threshold_matches_sglang_low_confidence(tau, fdfo):
    """Peer parity: the same logits give the same commits at every step and the same forwards."""
    prompts = OFFSET_PROMPTS[:3]
    ours = run_offsets(FastDllmThreshold, {"tau": tau}, fdfo, 2, prompts)[:2]
    peer = run_offsets(LowConfidence, {"threshold": tau}, fdfo, 2, prompts)[:2]
    assert ours == peer
    assert sum(len(s) for s in ours[1]) > 2 * len(prompts)  # several steps compared


def test_states_follow_rows_across_rounds():
    """FDFO: requests leave the batch in different rounds; each one's SlowFast state moves with it
    (the batch state is re-gathered) and it still decodes exactly as the reference."""
    prompts = OFFSET_PROMPTS[:3] + [[51, 52]]
    _, seen, slots, runner = run_offsets(SlowFast, {"k": 2}, True, 3, prompts)
    steps = reference_block(make_sampler("slowfast:k=2"),
                            torch.tensor([p + [MASK] * (L - len(p)) for p in prompts]), lambda n: runner.seq[slots, n])
    assert len({len(s) for s in seen}) > 1  # the batch changed between rounds
    assert [s[-1] for s in seen] == [t.tolist() for t in steps[-1]]
