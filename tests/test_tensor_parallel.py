"""Rank-consistent picks (issue "past one GPU"): under tensor parallelism a rank holds its own heads, so a pick
scored on them (dLLM-Cache's V-verify, Elastic-Cache's drift test) would differ per rank. The core makes every pick
from sums added over the ranks (``LayerOps.reduce``), so every rank picks the rows the whole model's heads pick.

Two gloo processes on this CPU run the core's host step (``PackedStep`` over ``dllm_core.testing.PackedHostStep``)
with sharded heads and a sharded FFN, each layer's attention output and FFN all-reduced as a host's row-parallel
layers do: both ranks recompute the same rows as one process (the same work) and give its hidden states; without
``reduce`` the ranks' V-verify picks part ways."""
import multiprocessing as mp

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dllm_core import load_model
from dllm_core.models.layers import apply_rope
from dllm_core.testing import PackedHostStep, build_tiny_checkpoint

WORLD = 2
SPECS = ["dllm:kp=3,kr=2,rho=0.25", "dllm:kp=3,kr=2,rho=0.25,select=key", "dllm:kp=3,kr=2,rho=0.25,metric=l2",
         "elastic:gamma=0.999,window=2,probe=1", "dual", "dpad:window=4,decay=none,tail=1"]


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t


def shard_ops(model, rank: int, picks_reduced: bool):
    """``make_ops`` of rank ``rank``: its heads of Q / K / V (and O's columns), its columns of the FFN's gate / up (and
    down's rows), the attention output and the FFN all-reduced; ``reduce`` for the picks when ``picks_reduced``."""
    from types import SimpleNamespace

    def make(layer, step):
        Hq, Hkv, D = layer.n_heads, layer.n_kv, layer.head_dim
        hq, hkv, f = Hq // WORLD, Hkv // WORLD, layer.gate_proj.out_features // WORLD
        qs, ks, fs = (slice(rank * w, (rank + 1) * w) for w in (hq * D, hkv * D, f))

        def lin(m, rows, x):
            return F.linear(x, m.weight[rows], None if m.bias is None else m.bias[rows])

        def rope(t, n, pos):
            r = model.rotary(pos[None], t.dtype)
            return apply_rope(t.view(-1, n, D).transpose(0, 1)[None], r)[0].transpose(0, 1).flatten(1)

        def qkv(x, pos):
            h = layer.attn_norm(x)
            return rope(lin(layer.q_proj, qs, h), hq, pos), rope(lin(layer.k_proj, ks, h), hkv, pos), \
                lin(layer.v_proj, ks, h)

        def attend(q, k, v, rows):
            o = step.attention(q, k, v, rows, hq, hkv, D ** -0.5)
            return all_reduce(F.linear(o, layer.o_proj.weight[:, qs]))

        def ffn(h):
            h = layer.ffn_norm(h)
            u = F.silu(lin(layer.gate_proj, fs, h)) * lin(layer.up_proj, fs, h)
            return all_reduce(F.linear(u, layer.down_proj.weight[:, fs]))

        ops = SimpleNamespace(qkv=qkv, value=lambda x: lin(layer.v_proj, ks, layer.attn_norm(x)), attend=attend,
                              ffn=ffn, heads=(hq, hkv, D))
        if picks_reduced:
            ops.reduce = all_reduce
        return ops
    return make


def rank_main(rank: int, ckpts: dict, init: str, out: str) -> None:
    """One rank: every architecture's step for every spec, with the picks reduced over the ranks and without."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    res = {}
    with torch.no_grad():
        for arch, ckpt in ckpts.items():
            model = load_model(ckpt)
            a = model.args
            for reduced in (True, False):
                for spec in SPECS if reduced else SPECS[:1]:
                    h = PackedHostStep(model, spec, make_ops=shard_ops(model, rank, reduced),
                                       kv=a.n_kv_heads * a.head_dim // WORLD)
                    res[arch, spec, reduced] = (h.run(h.x), h.step.work())
    torch.save(res, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' answers (spawned: no process group inherited from this process) and each checkpoint."""
    tmp = tmp_path_factory.mktemp("tp")
    ckpts = {a: str(build_tiny_checkpoint(tmp / a, a)) for a in ("llada", "dream")}
    ctx = mp.get_context("spawn")
    outs = [str(tmp / f"rank{r}.pt") for r in range(WORLD)]
    procs = [ctx.Process(target=rank_main, args=(r, ckpts, str(tmp / "init"), outs[r])) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0, f"rank exited with {p.exitcode}"
    return [torch.load(o) for o in outs], ckpts


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_two_ranks_pick_what_one_process_picks(ranks, arch):
    (r0, r1), ckpts = ranks
    model = load_model(ckpts[arch])
    for spec in SPECS:
        with torch.no_grad():
            h = PackedHostStep(model, spec)
            x, w = h.run(h.x), h.step.work()
        (x0, w0), (x1, w1) = r0[arch, spec, True], r1[arch, spec, True]
        assert torch.equal(w0, w) and torch.equal(w1, w), spec  # the same rows recomputed as one process
        assert torch.equal(x0, x1), spec  # every rank holds the same hidden states
        torch.testing.assert_close(x0, x, atol=1e-5, rtol=1e-5, msg=spec)
        if spec == SPECS[0]:  # picks on a rank's own heads part ways
            assert not torch.equal(r0[arch, spec, False][0], x), "picks on a rank's own heads happened to agree"
