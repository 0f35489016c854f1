"""One SGLang server, many requests' own options: ``custom_params: {"dllm": {...}}`` (sampler, steps, cache) and SGLang's
sampling parameters (temperature, top_p, top_k) go through the core's one options builder, as vLLM's ``vllm_xargs``;
what a diffusion decode cannot honour, or the launched server cannot serve, is refused by name (the scheduler's 400).

In-process, on the CPU stand-in (``tests/sglang_cpu.py``): requests with different options decode in one batch, each
equal to the embedded engine with the same options."""
from types import SimpleNamespace

import json

import pytest
import torch

pytest.importorskip("sglang.srt.dllm.algorithm")

from dllm_core import load_model  # noqa: E402
from dllm_core.engine import GenerationConfig, generate  # noqa: E402
from dllm_core.testing import build_tiny_checkpoint  # noqa: E402
from integrations.sglang.algorithm import DllmCore  # noqa: E402
from sglang_cpu import BlockDriver, CpuModelRunner, load_sglang_model  # noqa: E402
from sglang.srt.dllm.config import DllmConfig  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

L, GEN = 8, 24
PROMPTS = [[20 + i for i in range(5)], [40 + 3 * i for i in range(L)], [60 + i for i in range(13)]]
LAUNCH = {"sampler": "low_confidence", "steps": 12, "cache": "dllm:kp=3,kr=2,rho=0.5"}
# each request's custom_params.dllm, and the embedded engine's options for the same request
MIXED = [({}, ("low_confidence", 12, "dllm:kp=3,kr=2,rho=0.5")),
         ({"sampler": "threshold:tau=0.7", "steps": GEN, "cache": "dual"}, ("threshold:tau=0.7", GEN, "dual")),
         ({"cache": "prefix:every=1"}, ("low_confidence", 12, "none"))]  # the vanilla loop's tokens


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    load_plugins()
    dirs = {a: build_tiny_checkpoint(tmp_path_factory.mktemp(f"sg_rq_{a}"), a) for a in ("llada", "dream")}
    return {a: (d, load_sglang_model(d), load_model(d)) for a, d in dirs.items()}


def serve(sg, mask, launch: dict, sampling: list[dict], prompts=PROMPTS) -> list[list[int]]:
    algo = DllmCore(DllmConfig("DllmCore", launch, L, mask, 8))
    runner = CpuModelRunner(sg, max_len=64, max_reqs=len(prompts))
    return BlockDriver(algo, runner).generate(prompts, GEN, mask, sampling=sampling)


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_requests_with_their_own_options_decode_in_one_batch_equal_the_embedded_engine(models, arch):
    _, sg, ref = models[arch]
    mask = ref.args.mask_token_id
    got = serve(sg, mask, LAUNCH, [{"custom_params": {"dllm": own}} for own, _ in MIXED])
    for p, out, (own, (sampler, steps, cache)) in zip(PROMPTS, got, MIXED):
        cfg = GenerationConfig(gen_length=GEN, block_length=L, steps=steps, sampler=sampler, cache=cache)
        assert out == generate(ref, [p], cfg).tokens[0].tolist(), own
    assert got[2] != got[0] or got[1] != got[0]  # the options changed something


def test_a_requests_temperature_is_the_samplers_with_the_servers_seed(models):
    """temperature / top_p / top_k are the proposal sampler's (greedy unless sent); a sampled request without a
    seed draws from the server's generator (the launch YAML's ``seed``): the same server seed gives the same tokens,
    another seed other tokens; temperature 0 is the greedy decode."""
    _, sg, ref = models["llada"]
    mask = ref.args.mask_token_id
    hot = [{"temperature": 1.5, "top_k": 50}] * len(PROMPTS)
    greedy = serve(sg, mask, LAUNCH, [{}] * len(PROMPTS))
    assert serve(sg, mask, LAUNCH, [{"temperature": 0.0}] * len(PROMPTS)) == greedy
    a, b = serve(sg, mask, {**LAUNCH, "seed": 1}, hot), serve(sg, mask, {**LAUNCH, "seed": 1}, hot)
    assert a == b and a != greedy
    assert serve(sg, mask, {**LAUNCH, "seed": 2}, hot) != a


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_a_sampled_request_with_a_seed_draws_what_the_embedded_engine_draws_with_that_seed(models, arch):
    """A request's ``sampling_seed`` is its own generator (``ResponseSlots.admit``): sampled among requests with
    other seeds and options, each decodes what ``generate`` decodes for its prompt alone with its seed, whatever
    its batch; the same seed gives the same tokens, another seed others."""
    _, sg, ref = models[arch]
    mask = ref.args.mask_token_id
    cfg = GenerationConfig(gen_length=GEN, block_length=L, steps=12, sampler="low_confidence", cache="dual",
                           temperature=0.9, top_p=0.95)
    hot = {"temperature": 0.9, "top_p": 0.95, "custom_params": {"dllm": {"cache": "dual"}}}
    got = serve(sg, mask, LAUNCH, [{**hot, "sampling_seed": 7}, {}, {**hot, "sampling_seed": 8}])
    alone = serve(sg, mask, LAUNCH, [{**hot, "sampling_seed": 7}], prompts=PROMPTS[:1])
    assert got[0] == alone[0] == generate(ref, [PROMPTS[0]], cfg, seed=7).tokens[0].tolist()
    assert got[2] == generate(ref, [PROMPTS[2]], cfg, seed=8).tokens[0].tolist()
    assert got[2] != generate(ref, [PROMPTS[2]], cfg, seed=7).tokens[0].tolist()


def config(ckpt, yaml_text: str, tmp_path):
    (tmp_path / "algo.yaml").write_text(yaml_text + "\n")
    sa = ServerArgs(model_path=str(ckpt), dllm_algorithm="DllmCore", dllm_algorithm_config=str(tmp_path / "algo.yaml"),
                    device="cpu")
    sa.resolve_once()
    return DllmConfig.from_server_args(sa)


def request(own=None, logprobs=False, **sampling):
    sp = SamplingParams(max_new_tokens=2 * L, custom_params=None if own is None else {"dllm": own}, **sampling)
    return SimpleNamespace(origin_input_ids=[20, 21], sampling_params=sp, return_logprob=logprobs)


WHOLE = f"block_size: {L}\nsampler: low_confidence\nsteps: 12\ncache: dual"
REFUSED = [
    (WHOLE, request({"sampler": "nope"}), "custom_params.dllm.sampler: --sampler: unknown policy 'nope'; allowed: "),
    (WHOLE, request({"stream": True}), "custom_params.dllm.stream: unknown dllm option; allowed: ['block_length', "
                                       "'sampler', 'steps', 'temperature', 'top_k', 'top_p']"),
    (WHOLE, request({"steps": 0}), "custom_params.dllm.steps"),
    (WHOLE, request({"cache": "none"}), "custom_params.dllm.cache 'none': this server decodes each response as one "
                                        "canvas (launched with cache dual)"),
    (WHOLE, request({"cache": "dllm:kp=0"}), "custom_params.dllm.cache.kp must be >= 1, got 0"),
    (WHOLE, request({"block_length": 4}), "custom_params.dllm.block_length 4: this server's block is SGLang's"),
    (WHOLE, request({"seed": 3}), "custom_params.dllm.seed: a request's seed is its sampling_params.sampling_seed"),
    (WHOLE, request({"temperature": 0.5}, temperature=0.7), "temperature 0.7 and custom_params.dllm.temperature 0.5 "
                                                             "differ: send one of them"),
    (WHOLE, request(min_p=0.1), "min_p: not supported by a diffusion decode"),
    (WHOLE, request(frequency_penalty=0.5), "frequency_penalty: not supported by a diffusion decode"),
    (WHOLE, request(json_schema='{"type": "object"}'), "json_schema: not supported by a diffusion decode"),
    (WHOLE, request("dual"), "custom_params.dllm must be an object of dllm options, got 'dual'"),
    (f"block_size: {L}\ncache: canvas", request({"cache": "dual"}), "custom_params.dllm.cache 'dual': this server "
                                                                     "decodes its scheduler's block canvas"),
    (f"block_size: {L}\ncache: canvas", request({"cache": "canvas:kr=2"}), "custom_params.dllm.cache 'canvas:kr=2': "
                                                                           "dLLM-Cache over the block needs a launch"),
]


@pytest.mark.parametrize("yaml_text,req,error", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_what_a_request_cannot_get_is_refused_by_name(models, tmp_path, yaml_text, req, error):
    cfg = config(models["llada"][0], yaml_text, tmp_path)
    got = cfg.validate_request(req)
    assert got is not None and got.startswith("DllmCore: ") and error in got, got


def test_what_a_launch_serves_is_admitted(models, tmp_path):
    whole, block = (config(models["llada"][0], t, tmp_path) for t in (WHOLE, f"block_size: {L}\ncache: 'canvas:kr=2'"))
    for own in ({}, {"sampler": "threshold:tau=0.8", "steps": 16, "cache": "dllm:kp=4,kr=2"},
                {"cache": "prefix:every=1"}, {"cache": "elastic:gamma=0.9"}, {"block_length": L, "top_p": 0.9}):
        assert whole.validate_request(request(own, temperature=0.7)) is None, own
    for own in ({"cache": "none"}, {"cache": "canvas:kr=3,rho=0.5"}, {"sampler": "slowfast"}):
        assert block.validate_request(request(own)) is None, own
    assert block.validate_request(request(logprobs=True)) is None  # logprobs on the block canvas too
    assert whole.validate_request(request(temperature=0.7, sampling_seed=5)) is None  # its own generator
    assert whole.validate_request(request(logprobs=True)) is None  # reported by the whole-response host


def test_a_served_run_of_32_mixed_requests_selects_rows_in_buckets(models, monkeypatch):
    """32 requests of 8 prompt lengths and 4 policies (``dllm``, ``dual``, ``prefix``, ``dpad``) through SGLang's
    loop: every cached layer selects its recomputed rows to a size of the bucket set ({16, 32, 64, ...} or the
    forward's rows; ``executor.bucket``), never to a count read from the device. (The forward's own row count is the
    host's batch layout, each request's [0, P + G) in the ``StepContext``'s packed rows: not padded to buckets yet.)"""
    from dllm_core.cache import executor

    _, sg, ref = models["llada"]
    mask = ref.args.mask_token_id
    seen, select = [], executor._recomputed
    monkeypatch.setattr(executor, "_recomputed", lambda rec, bound: (seen.append((rec.shape[0], bound)),
                                                                     select(rec, bound))[1])
    prompts = [[20 + (i * 7 + j) % 40 for j in range(3 + i % 8)] for i in range(32)]
    own = [{}, {"cache": "dual"}, {"cache": "prefix"}, {"cache": "dpad:window=8,decay=none,tail=2"}]
    out = serve(sg, mask, LAUNCH, [{"custom_params": {"dllm": own[i % 4]}} for i in range(32)], prompts=prompts)
    assert len(out) == 32 and all(len(o) == GEN for o in out)
    assert seen and all(b is not None for _, b in seen), "a cached layer read its row count from the device"
    buckets = {16 << k for k in range(16)}
    assert all(b in buckets or b >= n for n, b in seen), sorted({(n, b) for n, b in seen if b not in buckets})[:5]
    assert len({b for _, b in seen}) <= 8, sorted({b for _, b in seen})


def test_a_served_runs_cached_steps_take_shapes_of_the_bucket_set(models, monkeypatch):
    """32 requests of mixed prompt lengths, each with its own cache (``custom_params``: Fast-dLLM, dLLM-Cache, DPad,
    Elastic), served in batches of 1 to 20 on the whole-response path, and the distinct shapes of its cached steps
    (``StepShapes``; issue 55's fixed shapes). As served on a CPU, every cached layer recomputes a row count of the
    bucket set {16, 32, 64, ...} or the forward's rows, which follow each batch's requests. With ``buckets`` (what a
    host that captures a graph per shape sets) the forward's rows, the attention's requests and keys are padded too:
    every shape is of the bucket set, and every answer is the same."""
    from dllm_core.cache.graphs import StepShapes
    from dllm_core.engine.responses import ResponseLifecycle

    _, sg, ref = models["llada"]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 90, (int(n),), generator=g).tolist() for n in torch.randint(2, 25, (32,), generator=g)]
    caches = ["dual", "prefix", "dllm:kp=3,kr=2,rho=0.5", "dpad:window=4,decay=none,tail=1", "elastic:gamma=0.9"]
    sampling = [{"custom_params": {"dllm": {"cache": caches[i % len(caches)]}}} for i in range(len(prompts))]
    pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
    runs = {}
    for buckets in (False, True):
        monkeypatch.setattr(ResponseLifecycle, "buckets", buckets)
        with StepShapes() as shapes:  # in batches of 1, 3, 8 and 20 requests
            out = [serve(sg, ref.args.mask_token_id, LAUNCH, sampling[a:b], prompts[a:b])
                   for a, b in ((0, 1), (1, 4), (4, 12), (12, 32))]
        layers = {s[1:] for s in shapes.seen if s[0] == "layer"}
        attention = {s[1:] for s in shapes.seen if s[0] == "attention"}
        assert layers and attention
        assert all(n == N or (n >= 16 and pow2(n)) for N, n in layers), sorted(layers)
        runs[buckets] = out
        print(json.dumps({"buckets": buckets, "layer_shapes": len(layers), "forward_rows": sorted({N for N, _ in layers}),
                          "attention_shapes": sorted(attention),
                          "forwards": sum(v for s, v in shapes.seen.items() if s[0] == "attention") // 2}))
    assert all(N >= 16 and pow2(N) for N, _ in layers), sorted(layers)
    assert all(pow2(m) and pow2(T) and q == min(T, q) for m, q, T in attention), sorted(attention)
    assert runs[True] == runs[False]
