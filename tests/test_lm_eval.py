"""``lm_eval --model dllm`` (dllm_core/harness): lm-evaluation-harness runs the shipped task models on the shipped
task data and agrees exactly with ``dllm eval`` (diffusion policies, AR greedy, lossless DFlash / TokenSwift);
LLaDA's Monte-Carlo log-likelihood ranks multiple choices; registration, discovery and errors."""
import importlib.metadata as md
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import Registry, get_model, model_registry  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from dllm_core.harness import MODEL_TARGET, TASKS_DIR, register  # noqa: E402
from dllm_core.harness.data import ARITHMETIC_JSONL, arithmetic_rows, read_jsonl  # noqa: E402
from dllm_core.harness.likelihood import diffusion_logits, mc_loglikelihood  # noqa: E402
from dllm_core.harness.model import DllmLM, cut_at, encode_pair  # noqa: E402
from dllm_core.tasks import Arithmetic, final_answer  # noqa: E402
from dllm_core.tasks.evaluate import evaluate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
LLADA, DREAM, QWEN, LLADA2 = (MODELS / n for n in ("llada-tasks", "dream-tasks", "qwen3-tasks", "llada2-tasks"))
N = 12  # examples per harness run (the first N of the shipped split = dllm eval --n N)
CANVAS = {"gen_length": 24, "block_length": 8}  # the arithmetic task's canvas (dllm eval's task_config)

pytestmark = pytest.mark.skipif(not all((d / "config.json").is_file() for d in (LLADA, DREAM, QWEN)),
                                reason="shipped task models missing")


@pytest.fixture(scope="module")
def tasks():
    register()
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


def harness(tasks, task: str, model_args: dict, limit: int = N) -> dict:
    out = simple_evaluate(model="dllm", model_args=model_args, tasks=[task], limit=limit, apply_chat_template=True,
                          log_samples=True, task_manager=tasks)
    return {"results": out["results"][task], "samples": sorted(out["samples"][task], key=lambda s: s["doc_id"])}


def chat(lm: DllmLM, text: str) -> str:
    return lm.apply_chat_template([{"role": "user", "content": text}])


# --- data and registration -------------------------------------------------------------------------------------
def test_shipped_data_is_the_task_suite():
    rows = read_jsonl(ARITHMETIC_JSONL)
    assert rows == arithmetic_rows()  # regenerated exactly (python -m dllm_core.harness.data)
    exs = Arithmetic().examples("test", len(rows))
    assert [(r["prompt"], r["answer"]) for r in rows] == [(e.prompt, e.answer) for e in exs]
    for r in rows:
        assert len(set(r["choices"])) == 4 and r["choices"][r["label"]] == r["response"]
        assert [final_answer(c) == r["answer"] for c in r["choices"]].count(True) == 1
    assert sorted({r["label"] for r in rows}) == [0, 1, 2, 3]  # the right choice is not always in one place


def test_registered_for_lm_eval():
    register()
    register()  # idempotent
    assert get_model("dllm") is DllmLM
    assert {"hf", "vllm", "dummy"} <= set(model_registry)  # lm-eval's own models stay registered


def test_entry_points_resolve_with_lm_eval_plugin_discovery():
    """The installed package advertises the model and the task directory the way lm-eval's plugin discovery
    reads them: an ``lm_eval.models`` entry point registered as a lazy placeholder materialises DllmLM."""
    (ep,) = [e for e in md.entry_points(group="lm_eval.models") if e.name == "dllm"]
    assert ep.value == MODEL_TARGET
    fresh = Registry("model")
    fresh.register(ep.name, target=ep)
    assert fresh.get("dllm") is DllmLM
    (tp,) = [e for e in md.entry_points(group="lm_eval.tasks") if e.name == "dllm"]
    import importlib.util

    assert Path(importlib.util.find_spec(tp.value).submodule_search_locations[0]) == TASKS_DIR
    assert {p.name for p in TASKS_DIR.glob("*.yaml")} == {"dllm_arithmetic.yaml", "dllm_arithmetic_mc.yaml"}


# --- generate_until == dllm eval ---------------------------------------------------------------------------------
@pytest.mark.parametrize("sampler,cache", [("low_confidence", "none"), ("threshold:tau=0.9", "dual")])
def test_arithmetic_matches_dllm_eval(tasks, sampler, cache):
    run = evaluate(LLADA, [Arithmetic()], n=N, batch_size=N, sampler=sampler, cache=cache)["arithmetic"]
    got = harness(tasks, "dllm_arithmetic", {"pretrained": str(LLADA), "sampler": sampler, "cache": cache,
                                             "batch_size": 5, **CANVAS})
    assert [s["resps"][0][0] for s in got["samples"]] == run.texts  # token-exact texts, batches of 5 vs 12
    assert [s["filtered_resps"][0] for s in got["samples"]] == [final_answer(t) or "[invalid]" for t in run.texts]
    assert got["results"]["exact_match,final-answer"] == run.accuracy
    assert run.accuracy >= 0.75  # a real model: the agreement is not on empty answers


def test_ar_target_greedy_and_speculative_match_dllm_eval(tasks):
    """Plain greedy (dllm eval's batched decoding) and DFlash / TokenSwift speculation give identical answers."""
    run = evaluate(QWEN, [Arithmetic()], n=N, batch_size=N)["arithmetic"]
    base = {"pretrained": str(QWEN), "gen_length": 24, "batch_size": N}
    for extra in ({}, {"spec": "dflash", "drafter": str(MODELS / "dflash-qwen3-tasks")},
                  {"spec": "tokenswift", "drafter": str(MODELS / "tokenswift-qwen3-tasks")}):
        got = harness(tasks, "dllm_arithmetic", {**base, **extra})
        assert [s["resps"][0][0] for s in got["samples"]] == run.texts, extra
        assert got["results"]["exact_match,final-answer"] == run.accuracy
    assert run.accuracy >= 0.75


@pytest.fixture(scope="module")
def llada_lm():
    return DllmLM(pretrained=str(LLADA), batch_size=4, mc_num=32, mc_batch=16, **CANVAS)


def test_until_cuts_the_answer_where_the_harness_expects(llada_lm):
    rows = read_jsonl(ARITHMETIC_JSONL)[:6]
    run = evaluate(LLADA, [Arithmetic()], n=6, batch_size=6)["arithmetic"]
    reqs = [Instance("generate_until", r, (chat(llada_lm, r["prompt"]), {"until": until, "do_sample": False}), 0)
            for r, until in zip(rows, [["="], ["\n"], ["####", "="], "-", [], ["nowhere"]])]
    got = llada_lm.generate_until(reqs, disable_tqdm=True)
    t = run.texts  # dllm eval's texts (cut at EOS / EOT), then the earliest until string
    assert got == [t[0].split("=")[0], t[1].split("\n")[0], t[2].split("=")[0], t[3].split("-")[0], t[4], t[5]]
    assert all("=" in x for x in t[:4])  # every cut above really cut something
    assert cut_at("a=b\n#### 3", ["\n", "="]) == "a" and cut_at("x", None) == "x"


# --- loglikelihood -------------------------------------------------------------------------------------------------
def test_one_token_estimate_is_exact(llada_lm):
    """With a one-token continuation every sample masks exactly it (l = L = 1): the estimate is log p itself."""
    m = llada_lm.backend.model
    tok = llada_lm.tok
    text = chat(llada_lm, "Tom has 3 coins. How many coins does Tom have now?")
    ctx = tok(text, add_special_tokens=False)["input_ids"]
    cont = tok("3", add_special_tokens=False)["input_ids"]
    assert len(cont) == 1
    est = mc_loglikelihood(m, ctx, cont, m.args.mask_token_id, mc_num=4, seed=7)
    x = torch.tensor([ctx + [m.args.mask_token_id]])
    exact = diffusion_logits(m, x, len(ctx), m.args.mask_token_id)[0, -1].log_softmax(-1)[cont[0]].item()
    assert math.isclose(est, exact, rel_tol=1e-5)


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_estimator_variance_shrinks_with_mc_num(request, arch):
    """Over 16 seeds, 16x the samples cut the estimate's variance ~16x (measured 13.8x LLaDA, 13x Dream) around
    the same mean (tiny random checkpoints of conftest: light-tailed losses, so 16 seeds measure the variance;
    a trained model's rare large losses need far more)."""
    m = request.getfixturevalue(arch)
    prefix, target = [25, 26, 27, 28, 29, 21, 33], [30, 31, 32, 40, 41, 42, 43, 44]

    def spread(mc_num):
        est = torch.tensor([mc_loglikelihood(m, prefix, target, m.args.mask_token_id, mc_num, 4, seed=s)
                            for s in range(16)])
        return est.var().item(), est.mean().item()

    (v4, m4), (v16, _), (v64, m64) = spread(4), spread(16), spread(64)
    assert v64 < v16 < v4 and v64 < v4 / 8
    assert abs(m64 - m4) < 3 * math.sqrt(v4 / 16)  # the same expectation


def test_multiple_choice_ranks_the_right_answer(tasks):
    """dllm_arithmetic_mc through the harness with LLaDA's Monte-Carlo estimate (mc_num 32): the right one of 4
    choices ranks first on 8 / 8 of the first docs with LLaDA and 7 / 8 with Dream (chance: 2 / 8; the rates
    on all 200: docs/eval.md)."""
    for d, measured in ((LLADA, 1.0), (DREAM, 0.875)):
        got = harness(tasks, "dllm_arithmetic_mc", {"pretrained": str(d), "mc_num": 32, "mc_batch": 32}, limit=8)
        assert got["results"]["acc,none"] >= measured, (d.name, got["results"])


def test_ar_loglikelihood_is_exact_teacher_forcing():
    """An AR target's log-likelihood: one forward equals token-by-token decoding with a KV cache, and the
    greedy flag is true exactly for the model's own greedy continuation."""
    from transformers import DynamicCache

    lm = DllmLM(pretrained=str(QWEN))
    run = evaluate(QWEN, [Arithmetic()], n=2, batch_size=2)["arithmetic"]
    ctx = chat(lm, run.examples[0].prompt)
    (ll, greedy), (_, other) = lm.loglikelihood([Instance("loglikelihood", {}, (ctx, run.texts[0]), 0),
                                                 Instance("loglikelihood", {}, (ctx, run.texts[1]), 0)])
    assert greedy and not other
    prefix, target = encode_pair(lm.tok, ctx, run.texts[0])
    m, cache, total = lm.backend.model, DynamicCache(), 0.0
    with torch.no_grad():
        logits = m(torch.tensor([prefix]), past_key_values=cache, use_cache=True).logits[0, -1]
        for t in target:
            total += logits.float().log_softmax(-1)[t].item()
            logits = m(torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits[0, -1]
    assert math.isclose(ll, total, rel_tol=1e-4)


def llada_suffix_greedy(m, prefix: list[int], L: int, mask_id: int) -> list[int]:
    """LLaDA's ``suffix_greedy_prediction`` written out: L masks after the prefix, each step commits the argmax of
    the single most confident masked position."""
    x = torch.tensor([prefix + [mask_id] * L])
    for _ in range(L):
        masked = (x[0] == mask_id).nonzero()[:, 0]
        conf, tok = diffusion_logits(m, x, len(prefix), mask_id)[0, masked].softmax(-1).max(-1)
        x[0, masked[conf.argmax()]] = tok[conf.argmax()]
    return x[0, len(prefix):].tolist()


def test_greedy_check_is_llada_suffix_greedy_prediction():
    lm = DllmLM(pretrained=str(LLADA), mc_num=4, greedy_check=True)
    m, mask_id, flags, want = lm.backend.model, lm.backend.model.args.mask_token_id, [], []
    for row in read_jsonl(ARITHMETIC_JSONL)[:4]:
        ctx = chat(lm, row["prompt"])
        reqs = [Instance("loglikelihood", row, (ctx, c), 0) for c in row["choices"]]
        flags.append([g for _, g in lm.loglikelihood(reqs, disable_tqdm=True)])
        pairs = [encode_pair(lm.tok, ctx, c) for c in row["choices"]]
        want.append([llada_suffix_greedy(m, p, len(t), mask_id) == t for p, t in pairs])
    assert flags == want
    assert all(f.count(True) <= 1 for f in flags) and sum(map(sum, flags)) >= 2  # some are reproduced


# --- errors ---------------------------------------------------------------------------------------------------------
def test_option_errors_are_the_engines():
    from dllm_core.engine import GenerationConfig

    with pytest.raises(ValueError) as want:
        GenerationConfig(sampler="nope")
    with pytest.raises(ValueError) as got:
        DllmLM(pretrained=str(LLADA), sampler="nope")
    assert str(got.value) == str(want.value)
    with pytest.raises(ValueError, match=r"^--cache: unknown policy 'dul'; allowed: \["):
        DllmLM(pretrained=str(LLADA), cache="dul")
    with pytest.raises(ValueError, match=r"--model_args: unknown option\(s\) \['gen_len'\]; allowed: .*'gen_length'"):
        DllmLM(pretrained=str(LLADA), gen_len=24)
    with pytest.raises(ValueError, match=r"mc_num 10 must be a multiple of mc_batch 4"):
        DllmLM(pretrained=str(LLADA), mc_num=10, mc_batch=4)
    with pytest.raises(ValueError, match=r"spec must be one of \['dflash', 'none', 'tokenswift'\], got 'medusa'"):
        DllmLM(pretrained=str(QWEN), spec="medusa", drafter="x")
    with pytest.raises(ValueError, match=r"spec=dflash: speculation drafts for causal \(AR\) targets"):
        DllmLM(pretrained=str(LLADA), spec="dflash", drafter=str(MODELS / "dflash-qwen3-tasks"))
    with pytest.raises(ValueError, match=r"\['sampler'\]: diffusion options; .* is a causal \(AR\) checkpoint"):
        DllmLM(pretrained=str(QWEN), sampler="threshold")
    with pytest.raises(ValueError, match=r"--dtype must be one of"):
        DllmLM(pretrained=str(LLADA), dtype="fp8")
    with pytest.raises(ValueError, match=r"batch_size must be an integer, got 'auto'"):
        DllmLM(pretrained=str(LLADA), batch_size="auto")


def test_harness_flags_and_generation_kwargs(monkeypatch):
    """lm-eval's CLI always passes --batch_size (default 1) and --device (default cuda:0): model args win, and
    its default cuda:0 on a machine without it leaves this model's cpu; generation kwargs map onto the engine."""
    from dllm_core.harness.model import engine_overrides

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lm = DllmLM.create_from_arg_obj({"pretrained": str(LLADA), "batch_size": 5}, {"batch_size": 1, "device": "cuda:0",
                                                                                 "max_batch_size": None})
    assert (lm.cfg.batch_size, lm.cfg.device) == (5, "cpu")
    assert DllmLM.create_from_arg_obj({"pretrained": str(LLADA)}, {"batch_size": "3"}).cfg.batch_size == 3
    with pytest.raises(ValueError, match=r"^device cuda: CUDA is not available"):
        DllmLM.create_from_arg_obj({"pretrained": str(LLADA)}, {"device": "cuda"})
    assert engine_overrides({"until": ["\n"], "do_sample": False, "temperature": 0.7}) == {}
    assert engine_overrides({"do_sample": True, "temperature": 0.7, "top_k": 5}) == {"temperature": 0.7, "top_k": 5}
    with pytest.raises(ValueError, match=r"generation_kwargs: unsupported key\(s\) \['num_beams'\]; allowed: \["):
        engine_overrides({"num_beams": 2})


def test_device_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^device cuda: CUDA is not available .*available devices: \['cpu'"):
        DllmLM(pretrained=str(LLADA), device="cuda")


def test_undefined_likelihoods_say_why(llada_lm):
    with pytest.raises(NotImplementedError, match="no left-to-right factorisation"):
        llada_lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("text",), 0)])
    if (LLADA2 / "config.json").is_file():
        lm = DllmLM(pretrained=str(LLADA2), gen_length=24, block_length=8)
        with pytest.raises(NotImplementedError, match=r"defined for bidirectional masked-diffusion models \(LLaDA, "
                                                      r"Dream\); LLaDA2MoeModelLM attends block-causally"):
            lm.loglikelihood([Instance("loglikelihood", {}, ("Tom has", " 3"), 0)])


# --- the command line -----------------------------------------------------------------------------------------------
def test_cli_reproduces_dllm_eval():
    """``python -m dllm_core.harness`` (= ``dllm-lm-eval``): lm-eval's CLI with the model and tasks registered."""
    run = evaluate(LLADA, [Arithmetic()], n=4, batch_size=4)["arithmetic"]
    out = subprocess.run([sys.executable, "-m", "dllm_core.harness", "--model", "dllm", "--model_args",
                          f"pretrained={LLADA},gen_length=24,block_length=8,batch_size=4,threads=1", "--tasks",
                          "dllm_arithmetic", "--limit", "4", "--apply_chat_template"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    row = next(ln for ln in out.stdout.splitlines() if ln.startswith("|dllm_arithmetic"))
    cells = [c.strip() for c in row.strip("|").split("|")]  # Tasks|Version|Filter|n-shot|Metric||Value||Stderr
    assert cells[2:5] == ["final-answer", "0", "exact_match"] and float(cells[6]) == run.accuracy, row
