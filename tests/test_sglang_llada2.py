"""LLaDA2 in SGLang (CPU stand-in): SGLang's own ``LLaDA2MoeModelLM`` (its FusedMoE, RadixAttention,
paged KV pool, block-by-block prefill), loaded from the tiny published-layout checkpoint without remote
code, decoded by SGLang's own algorithms and by ours, equals the embedded engine token for token."""
import pytest
import torch

pytest.importorskip("sglang.srt.dllm.algorithm")

from dllm_core import load_model  # noqa: E402
from dllm_core.engine import GenerationConfig, generate  # noqa: E402
from dllm_core.engine.generate import block_causal_mask  # noqa: E402
from dllm_core.testing import build_tiny_checkpoint  # noqa: E402
from integrations.sglang.algorithm import DllmCore, FastDllmFactor, FastDllmThreshold, SlowFast  # noqa: E402
from dllm_core.models.hf_config import register_configs  # noqa: E402
from sglang_cpu import BlockDriver, CpuModelRunner, Row, load_sglang_model  # noqa: E402
from sglang.srt.dllm.algorithm.joint_threshold import JointThreshold  # noqa: E402
from sglang.srt.dllm.algorithm.low_confidence import LowConfidence  # noqa: E402
from sglang.srt.dllm.config import DllmConfig  # noqa: E402

L = 8
PROMPTS = [[0, 7, 9, 11, 13], list(range(20, 31)), list(range(40, 57))]  # the prompt tail in 3 grid offsets


@pytest.fixture(scope="module")
def models(llada2_dir):
    register_configs()
    return load_sglang_model(llada2_dir), load_model(llada2_dir)


def test_sglang_class_computes_the_native_logits(models):
    """SGLang's class (its weight loader: fused QKV, per-expert FusedMoE weights) over its paged KV, one
    grid block per forward, equals dllm_core's block-causal forward."""
    sg, ref = models
    assert type(sg).__name__ == "LLaDA2MoeModelLM"
    drv = BlockDriver(None, CpuModelRunner(sg, max_len=64, max_reqs=1), block_size=L)
    row = Row(list(range(30, 38)), L, drv.runner.alloc_slot())
    block = [40, 41, 42] + [ref.args.mask_token_id] * 5
    first = drv.runner.forward(drv.batch([row], [row.prompt])).logits_output.full_logits
    row.kv_len = L
    second = drv.runner.forward(drv.batch([row], [block])).logits_output.full_logits
    ids, pos = torch.tensor([row.prompt + block]), torch.arange(2 * L)[None]
    want = ref(ids, pos, block_causal_mask(torch.ones_like(ids, dtype=torch.bool), pos, L))[0]
    torch.testing.assert_close(torch.cat([first, second]), want, atol=1e-4, rtol=1e-4)


def _sglang(sg, algo, gen=16, forwards: list | None = None):
    runner = CpuModelRunner(sg, max_len=64, max_reqs=4)
    out = BlockDriver(algo, runner).generate(PROMPTS, gen, 5)
    if forwards is not None:
        forwards.append(runner.forwards)
    return out


@pytest.mark.parametrize("cls,cfg,sampler", [
    (DllmCore, {"sampler": "low_confidence", "steps": 16}, "low_confidence"),
    (FastDllmThreshold, {"tau": 0.5}, "threshold:tau=0.5"),
    (FastDllmFactor, {"f": 1.5}, "factor:f=1.5"),
    (SlowFast, {}, "slowfast"),
    (DllmCore, {"sampler": "threshold:tau=0.5,edit=0.5,post_edit=4"}, "threshold:tau=0.5,edit=0.5,post_edit=4"),
])
def test_our_algorithms_drive_sglang_llada2(models, cls, cfg, sampler):
    """Our algorithms on SGLang's LLaDA2 class, three requests of different lengths batched: the embedded
    engine's tokens."""
    sg, ref = models
    want = generate(ref, PROMPTS, GenerationConfig(gen_length=16, block_length=L, steps=16, sampler=sampler))
    out = _sglang(sg, cls(DllmConfig(cls.__name__, cfg, L, 5, 4)))
    assert out == want.tokens.tolist()


@pytest.mark.parametrize("sampler,steps", [
    ("low_confidence:schedule=llada2", 16), ("low_confidence:schedule=llada2", 6),
    ("threshold:tau=0.5,schedule=llada2", 4), ("threshold:tau=0.5,edit=0.5,post_edit=0,schedule=llada2", 16),
])
def test_official_schedule_drives_sglang_llada2(models, sampler, steps):
    """LLaDA2's official schedule (``schedule=llada2``) through DllmCore on SGLang's LLaDA2 class, three requests
    batched: the embedded engine's tokens - the option needs no adapter change. Forwards: no more than the default
    schedule's (a block that ends at a step that changed it takes SGLang's persisting forward, the one the
    default spends on a step committing nothing)."""
    sg, ref = models
    want = generate(ref, PROMPTS, GenerationConfig(gen_length=16, block_length=L, steps=steps, sampler=sampler))
    default = sampler.replace(",schedule=llada2", "").replace(":schedule=llada2", "")
    n = []
    out = _sglang(sg, DllmCore(DllmConfig("DllmCore", {"sampler": sampler, "steps": steps}, L, 5, 4)), forwards=n)
    _sglang(sg, DllmCore(DllmConfig("DllmCore", {"sampler": default, "steps": steps}, L, 5, 4)), forwards=n)
    assert out == want.tokens.tolist() and n[0] <= n[1]


@pytest.mark.parametrize("algo,cfg,sampler", [
    (LowConfidence, {"threshold": 0.5}, "threshold:tau=0.5"),
    (JointThreshold, {"threshold": 0.5, "edit_threshold": 0.5, "max_post_edit_steps": 4},
     "threshold:tau=0.5,edit=0.5,post_edit=4"),
    (JointThreshold, {"threshold": 0.7, "edit_threshold": 0.3, "max_post_edit_steps": 16},
     "threshold:tau=0.7,edit=0.3,post_edit=16"),
])
def test_sglang_own_algorithms_equal_ours(models, algo, cfg, sampler, monkeypatch):
    """SGLang's LowConfidence and LLaDA2.1 JointThreshold on its own LLaDA2 class decode what our
    threshold rule (with editing) decodes in the embedded engine. Precondition, checked: [MASK] is never
    the argmax (SGLang's rules take the plain argmax, ours never propose [MASK]; a random model whose
    argmax is [MASK] would have SGLang re-mask committed tokens)."""
    sg, ref = models
    argmax_mask = []
    logits = ref.logits
    monkeypatch.setattr(ref, "logits", lambda h: argmax_mask.append(bool((logits(h).argmax(-1) == 5).any()))
                        or logits(h))
    want = generate(ref, PROMPTS, GenerationConfig(gen_length=16, block_length=L, steps=16, sampler=sampler))
    assert not any(argmax_mask)
    n = []
    assert _sglang(sg, algo(DllmConfig(algo.__name__, cfg, L, 5, 4)), forwards=n) == want.tokens.tolist()
    assert _sglang(sg, DllmCore(DllmConfig("DllmCore", {"sampler": sampler}, L, 5, 4)), forwards=n) == want.tokens.tolist()
    assert n[0] == n[1]  # and in as many forwards (prefill rounds + denoise steps + the persisting ones)


def test_launch_reads_the_checkpoint_block_and_refuses_another(tmp_path):
    """SGLang's DllmConfig for LLaDA2 (the plugin's row): the checkpoint's block_size and mask id (the
    published 32 / 156895 when config.json names none); a YAML block_size that differs is refused."""
    import json

    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    d = build_tiny_checkpoint(tmp_path / "m", "llada2")

    def config(yaml_text, d=d):
        (tmp_path / "a.yaml").write_text(yaml_text)
        return DllmConfig.from_server_args(ServerArgs(model_path=str(d), dllm_algorithm="DllmCore",
                                                      dllm_algorithm_config=str(tmp_path / "a.yaml")))

    cfg = config("sampler: threshold:tau=0.5,edit=0.5\n")
    assert (cfg.block_size, cfg.mask_id) == (8, 5)
    with pytest.raises(ValueError, match=r"block_size 16 does not match the checkpoint's block_size 8 "
                                         r"\(LLaDA2MoeModelLM attends block-causally over blocks of 8\)"):
        config("block_size: 16\n")
    published = build_tiny_checkpoint(tmp_path / "p", "llada2")  # a new path: SGLang caches configs by path
    raw = json.loads((published / "config.json").read_text())
    del raw["block_size"], raw["mask_token_id"]
    (published / "config.json").write_text(json.dumps(raw))
    cfg = config("sampler: low_confidence\n", published)
    assert (cfg.block_size, cfg.mask_id) == (32, 156895)


SHIPPED = __import__("pathlib").Path(__file__).resolve().parents[1] / "models" / "llada2-tasks"


@pytest.mark.skipif(not (SHIPPED / "config.json").is_file(), reason="models/llada2-tasks not shipped")
def test_shipped_model_in_sglang_keeps_its_accuracy():
    """The shipped LLaDA2 task model on SGLang's own class, 16 held-out arithmetic prompts in flight: our
    FastDllmThreshold decodes the embedded engine's tokens, so its accuracy (>= 90 %) is the embedded one's."""
    from dllm_core import load_tokenizer
    from dllm_core.cli import stop_ids
    from dllm_core.tasks import make_task
    from dllm_core.tasks.evaluate import accuracy, generate_batched, prompts_of, task_config

    register_configs()
    sg, ref, tok = load_sglang_model(SHIPPED), load_model(SHIPPED, dtype=torch.float32), load_tokenizer(SHIPPED)
    task = make_task("arithmetic")
    examples = task.examples("test", 16)
    prompts = prompts_of(tok, examples)
    want = [list(t) for t in generate_batched(ref, prompts, task_config(task, "threshold:tau=0.9"), batch_size=16).tokens]
    algo = FastDllmThreshold(DllmConfig("FastDllmThreshold", {"tau": 0.9}, L, ref.args.mask_token_id, 16))
    got = BlockDriver(algo, CpuModelRunner(sg, max_len=128, max_reqs=16)).generate(prompts, task.gen_length,
                                                                                  ref.args.mask_token_id)
    assert got == want
    stop = stop_ids(tok, ref)
    assert accuracy(task, tok, stop, examples, got) >= 0.9
