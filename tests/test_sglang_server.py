"""SGLang's real server runtime (``sglang.launch_server``, its tokenizer manager, scheduler and model runner
processes) serving our dLLM algorithms on the shipped LLaDA / Dream task models, on this CPU through the
test-only harness ``tests/sglang_harness`` (sgl_kernel stand-in + SGLang changes applied at import time).

One server per algorithm configuration (module-scoped: every case of a configuration shares it; one alive at a
time). Each answer over HTTP equals the embedded engine's unbatched run with the same sampler and cache policy,
token for token, for concurrent requests of different prompt and answer lengths; on held-out examples the
server's accuracy is the embedded engine's. Bad requests get HTTP 400 and the server keeps serving (a soak of
hundreds of requests with client hang-ups and bad requests of many kinds among them); a bad
``--dllm-algorithm-config`` stops the launch with the option named.
"""
import concurrent.futures as cf
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("sglang.srt.dllm.algorithm")

from dllm_core import load_model, load_tokenizer  # noqa: E402
from dllm_core.cli import stop_ids  # noqa: E402
from dllm_core.engine import GenerationConfig, generate  # noqa: E402
from dllm_core.tasks import make_task  # noqa: E402
from dllm_core.tasks.evaluate import accuracy, generate_batched, prompts_of, task_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
from sglang_harness.server import SGLangServer  # noqa: E402
from sglang_harness.soak import bad_requests, soak  # noqa: E402

BLOCK = 8
EOS = 1  # config.json eos_token_id of both task models
N_HELD_OUT = 32


@dataclass(frozen=True)
class Served:
    """One server: model, ``--dllm-algorithm``, its YAML, and the embedded reference's sampler / steps."""
    model: str
    algorithm: str
    yaml: dict
    sampler: str  # the same rule as a dllm_core sampler spec (one token per step for fixed schedules)
    tp: int = 1  # --tp-size

    @property
    def cache(self) -> str:
        return self.yaml["cache"]

    def reference(self, model, prompt: list[int], gen: int) -> list[int]:
        cfg = GenerationConfig(gen_length=gen, block_length=BLOCK, steps=gen, sampler=self.sampler,
                               cache=self.cache)
        return generate(model, [prompt], cfg).tokens[0].tolist()


# One server per configuration, three configurations: the whole response with Fast-dLLM's dual cache on LLaDA and on
# Dream at --tp-size 2 (its shifted logits), and dLLM-Cache on LLaDA at --tp-size 2 (two ranks, one core each: its
# V-verify picks from sums all-reduced over the ranks; one rank's dLLM-Cache runs in-process in
# tests/test_sglang_dllm_cache.py; one rank's Dream: tests/test_sglang_fast_dllm.py). The
# other algorithm classes differ from these only in the core's sampler, and run SGLang's real algorithm loops over the
# same host in-process (tests/test_sglang_fast_dllm.py: FastDllmFactor / SlowFast with prefix and dual, both
# architectures; tests/test_sglang_dllm_cache.py: dLLM-Cache on Dream), so a launch each would add start-up time, not a
# code path.
SERVED = {
    "llada-DllmCore-dual": Served("llada-tasks", "DllmCore", {"sampler": "low_confidence",
                                                              "cache": "dual"}, "low_confidence"),
    "llada-FastDllmThreshold-dllm": Served("llada-tasks", "FastDllmThreshold",
                                           {"tau": 0.9, "cache": "dllm:kp=4,kr=2,rho=0.25"}, "threshold:tau=0.9", 2),
    "dream-DllmCore-dual": Served("dream-tasks", "DllmCore", {"sampler": "low_confidence",
                                                              "cache": "dual"}, "low_confidence", 2),
}


def launch_flags(s: Served, config: Path) -> list[str]:
    config.write_text(yaml.safe_dump({"block_size": BLOCK, **s.yaml}))
    return ["--dtype", "float32", "--dllm-algorithm", s.algorithm, "--dllm-algorithm-config", str(config),
            *(["--tp-size", str(s.tp)] if s.tp > 1 else [])]


@pytest.fixture(scope="module", params=list(SERVED), ids=list(SERVED))
def served(request, tmp_path_factory):
    s = SERVED[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    model_dir = ROOT / "models" / s.model
    with pytest.MonkeyPatch.context() as m:
        if s.tp > 1:  # one NUMA node here: each rank's core by hand
            m.setenv("SGLANG_CPU_OMP_THREADS_BIND", "|".join(str(r) for r in range(s.tp)))
        with SGLangServer(model_dir, *launch_flags(s, tmp / "algo.yaml"), log=tmp / "server.log") as srv:
            yield s, srv, load_model(model_dir, dtype=torch.float32), load_tokenizer(model_dir)


def serve_all(srv: SGLangServer, prompts: list[list[int]], gens: list[int]) -> list[list[int]]:
    """All requests at once (SGLang batches them), in order."""
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return [o["output_ids"] for o in pool.map(lambda pg: srv.generate(*pg), zip(prompts, gens))]


def assert_same(got: list[int], ref: list[int], gen: int) -> None:
    """SGLang stops at EOS: its answer is the reference up to and including the first EOS (or all of it)."""
    stop = ref.index(EOS) + 1 if EOS in ref else gen
    assert got == ref[:stop]


def test_concurrent_requests_equal_the_embedded_engine(served):
    """Eight concurrent requests (arithmetic and sort prompts of different lengths; answers of 1, 2 and 3
    blocks) through SGLang's scheduler: each equals the embedded engine's run with the same policy."""
    s, srv, model, tok = served
    prompts = [p for name in ("arithmetic", "sort") for p in prompts_of(tok, make_task(name).examples("test", 4))]
    gens = [BLOCK * (1 + i % 3) for i in range(len(prompts))]
    assert len({len(p) for p in prompts}) > 2
    for p, g, got in zip(prompts, gens, serve_all(srv, prompts, gens)):
        assert_same(got, s.reference(model, p, g), g)


def test_held_out_accuracy_is_the_embedded_engines(served):
    """32 held-out arithmetic examples (16 at --tp-size 2; 24-token answers, blocks of 8), 16 in flight at a time:
    the server's answers are the embedded engine's, so is its accuracy (at least 90 % on the shipped models)."""
    s, srv, model, tok = served
    task = make_task("arithmetic")
    examples = task.examples("test", N_HELD_OUT // s.tp)  # at --tp-size 2: 16, one wave (each step an exchange)
    prompts = prompts_of(tok, examples)
    ref = generate_batched(model, prompts, task_config(task, s.sampler, s.cache),
                           batch_size=1 if s.cache.startswith("dllm") else N_HELD_OUT).tokens
    got = []
    for i in range(0, len(prompts), 16):
        got += serve_all(srv, prompts[i:i + 16], [task.gen_length] * len(prompts[i:i + 16]))
    for g, r in zip(got, ref):
        assert_same(g, r, task.gen_length)
    stop = stop_ids(tok, model)
    assert accuracy(task, tok, stop, examples, got) == accuracy(task, tok, stop, examples, ref) >= 0.9


def test_bad_requests_get_400_and_the_server_keeps_serving(served):
    s, srv, model, tok = served
    prompt = prompts_of(tok, make_task("arithmetic").examples("test", 1))[0]
    status, body = srv.post("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0}})
    assert status == 400 and "max_new_tokens" in str(body), body
    mask = model.args.mask_token_id
    status, body = srv.post("/generate", {"input_ids": prompt[:3] + [mask] + prompt[3:],
                                          "sampling_params": {"max_new_tokens": BLOCK}})
    assert status == 400 and "mask" in str(body), body
    got = srv.generate(prompt, BLOCK)["output_ids"]
    assert_same(got, s.reference(model, prompt, BLOCK), BLOCK)
    got = srv.generate(prompt, BLOCK + 3)["output_ids"]  # not whole blocks: 2 blocks decoded, BLOCK + 3 emitted
    assert_same(got, s.reference(model, prompt, 2 * BLOCK)[:BLOCK + 3], BLOCK + 3)


SOAKED = "llada-DllmCore-dual"


@pytest.mark.parametrize("served", [SOAKED], indirect=True)
def test_a_requests_own_options_over_http(served):
    """``custom_params: {"dllm": {...}}`` picks a request's sampler, steps and cache on the launched server (equal to
    the embedded engine with those options); a sampled request with a seed is the embedded engine's with that seed,
    twice; what a request cannot get is a 400 naming the option, and the server keeps serving."""
    s, srv, model, tok = served
    prompt = prompts_of(tok, make_task("arithmetic").examples("test", 1))[0]
    own = {"sampler": "threshold:tau=0.7", "steps": 2 * BLOCK, "cache": "prefix:every=1"}
    status, body = srv.post("/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 2 * BLOCK, "temperature": 0.0, "custom_params": {"dllm": own}}})
    assert status == 200, body
    cfg = GenerationConfig(gen_length=2 * BLOCK, block_length=BLOCK, steps=2 * BLOCK, sampler="threshold:tau=0.7")
    assert_same(body["output_ids"], generate(model, [prompt], cfg).tokens[0].tolist(), 2 * BLOCK)
    hot = {"max_new_tokens": BLOCK, "temperature": 0.8, "sampling_seed": 3}  # its own generator
    runs = [srv.post("/generate", {"input_ids": prompt, "sampling_params": hot, **lp})
            for lp in ({}, {"return_logprob": True, "top_logprobs_num": 0})]
    cfg = GenerationConfig(gen_length=BLOCK, block_length=BLOCK, steps=BLOCK, sampler=s.sampler, cache=s.cache,
                           temperature=0.8, seed=3, logprobs=0)
    assert [r[0] for r in runs] == [200, 200], runs
    assert runs[0][1]["output_ids"] == runs[1][1]["output_ids"]
    want = generate(model, [prompt], cfg)
    assert_same(runs[0][1]["output_ids"], want.tokens[0].tolist(), BLOCK)
    got = runs[1][1]["meta_info"]["output_token_logprobs"]  # a sampled request's: the embedded engine's, to 1e-4
    assert [v for v, *_ in got] == pytest.approx(want.logprobs.token[0, :len(got)].tolist(), abs=1e-4) and got
    # logprobs: each output token's and its step's top 2, the embedded engine's (to 1e-4)
    status, body = srv.post("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": BLOCK,
                                          "temperature": 0.0}, "return_logprob": True, "top_logprobs_num": 2})
    assert status == 200, body
    want = generate(model, [prompt], GenerationConfig(gen_length=BLOCK, block_length=BLOCK, steps=BLOCK,
                                                      sampler=s.sampler, cache=s.cache, logprobs=2))
    assert_same(body["output_ids"], want.tokens[0].tolist(), BLOCK)
    got, top = body["meta_info"]["output_token_logprobs"], body["meta_info"]["output_top_logprobs"]
    assert len(got) == len(top) == len(body["output_ids"]) > 0
    for j, ((v, t, *_), alts) in enumerate(zip(got, top)):
        assert t == body["output_ids"][j] and v == pytest.approx(want.logprobs.token[0, j].item(), abs=1e-4)
        assert [a[1] for a in alts] == want.logprobs.top_ids[0, j].tolist()
        assert [a[0] for a in alts] == pytest.approx(want.logprobs.top[0, j].tolist(), abs=1e-4)
    # the same through SGLang's OpenAI route (/v1/completions: logprobs 2)
    model_id = srv.get("/v1/models")[1]["data"][0]["id"]
    status, oai = srv.post("/v1/completions", {"model": model_id, "prompt": prompt, "max_tokens": BLOCK,
                                               "temperature": 0.0, "logprobs": 2})
    assert status == 200, oai
    lp = oai["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([v for v, *_ in got], abs=1e-4)
    assert [v for d in lp["top_logprobs"] for v in sorted(d.values(), reverse=True)] == pytest.approx(
        [a[0] for alts in top for a in alts], abs=1e-4)
    for params, named in ((({"custom_params": {"dllm": {"cache": "none"}}}), "custom_params.dllm.cache"),
                          ({"custom_params": {"dllm": {"sampler": "nope"}}}, "custom_params.dllm.sampler"),
                          ({"custom_params": {"dllm": {"seed": 3}}}, "custom_params.dllm.seed"),
                          ({"min_p": 0.1}, "min_p")):
        status, body = srv.post("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": BLOCK,
                                                                                       **params}})
        assert status == 400 and named in str(body), (params, body)
    assert_same(srv.generate(prompt, BLOCK)["output_ids"], s.reference(model, prompt, BLOCK), BLOCK)


@pytest.mark.parametrize("served", [SOAKED], indirect=True)
def test_lm_eval_through_the_server_equals_the_embedded_route(served):
    """lm-eval's ``local-completions`` against the server (its options: the launch YAML) answers the shipped
    ``dllm_arithmetic`` examples as ``--model dllm`` does with the same policy (issue 35.2)."""
    pytest.importorskip("lm_eval")
    from lm_eval_routes import CANVAS, embedded, served as through

    s, srv, _, _ = served
    model_dir = ROOT / "models" / s.model
    assert through(srv.url, model_dir) == embedded(model_dir, **CANVAS, sampler=s.sampler, cache=s.cache)


@pytest.mark.parametrize("served", [SOAKED], indirect=True)
def test_soak_with_hang_ups_and_bad_requests(served):
    """120 requests of 8 prompts x answer lengths, 24 in flight, a fifth of the clients hanging up mid-request,
    bad requests of 18 kinds among them (3 of each): every bad one gets a 4xx naming its problem, no good one is
    lost and each answers the embedded engine's tokens every time; a probe answers the same before and after."""
    s, srv, model, tok = served
    prompts = [p for name in ("arithmetic", "sort") for p in prompts_of(tok, make_task(name).examples("test", 4))]
    gens = [BLOCK * (1 + i % 3) for i in range(len(prompts))]
    cases = [{"input_ids": p, "sampling_params": {"max_new_tokens": g, "temperature": 0.0}}
             for p, g in zip(prompts, gens)]
    probe = srv.generate(prompts[0], gens[0])["output_ids"]
    bad = bad_requests(prompts[0], model.args.vocab_size, 8192, model.args.mask_token_id, dllm=True)
    rep = soak(srv.url, cases, bad, n=120, in_flight=24, hang_up_share=0.2)
    assert not rep.lost and rep.served + rep.hung_up == 120, rep.lost[:3]
    for i, answers in rep.answers.items():
        assert len(answers) == 1, (i, answers)
        assert_same(list(next(iter(answers))), s.reference(model, prompts[i], gens[i]), gens[i])
    for name, (_, text) in bad.items():
        for status, body in rep.bad[name]:
            assert 400 <= status < 500 and text in body, (name, status, body[:300])
    assert srv.generate(prompts[0], gens[0])["output_ids"] == probe


@pytest.mark.parametrize("yaml_text,expected", [
    ("tau: 1.5\n", r"FastDllmThreshold\.tau must be in \[0\.0, 1\.0\], got 1\.5"),
    ("cache: dual\ncolour: blue\n", r"FastDllmThreshold has no option 'colour'"),
    ("cache: 'dllm:kp=0'\n", r"kp must be >= 1, got 0"),
], ids=["tau-out-of-range", "unknown-key", "bad-cache-spec"])
def test_bad_algorithm_config_stops_the_launch(tmp_path, yaml_text, expected):
    """The launch fails before any worker starts, naming the file and the offending option: SGLang's launch-time
    resolution of the server args (``ServerArgs.resolve_once``, which runs the algorithm's ``configure_server_args``,
    the code ``sglang.launch_server`` runs before it starts a process), here in-process."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()  # as the launch does: our entry point registers the algorithms and the model configs
    config = tmp_path / "bad.yaml"
    config.write_text(f"block_size: {BLOCK}\n" + yaml_text)
    args = ServerArgs(model_path=str(ROOT / "models" / "llada-tasks"), dllm_algorithm="FastDllmThreshold",
                      dllm_algorithm_config=str(config), device="cpu")
    with pytest.raises(ValueError, match=expected) as err:
        args.resolve_once()
    assert str(err.value).startswith(f"--dllm-algorithm-config {config}: "), err.value



TP_SERVED = ["llada-FastDllmThreshold-dllm", "dream-DllmCore-dual"]
TP_CACHES = ("dual", "prefix", "dllm:kp=4,kr=2,rho=0.25", "elastic:gamma=0.99,window=4,probe=1",
             "dpad:window=8,decay=none,tail=2")


@pytest.mark.parametrize("served", TP_SERVED, indirect=True)
def test_two_tensor_parallel_ranks_serve_every_policy_per_request(served):
    """A --tp-size 2 server (LLaDA's dLLM-Cache launch, Dream's dual one), per request (``custom_params``): every
    other policy of the whole response (``dual``, ``prefix``, dLLM-Cache, Elastic's drift test, DPad) answers the
    embedded engine's tokens, as the launch's own does above: no policy is refused or run exact under tensor
    parallelism."""
    s, srv, model, tok = served
    prompts = [p for name, n in (("arithmetic", 2), ("sort", 1)) for p in prompts_of(tok, make_task(name).examples(
        "test", n))]
    for cache in (c for c in TP_CACHES if c != s.cache):
        ref = Served(s.model, s.algorithm, {"cache": cache}, s.sampler)
        for p in prompts:
            status, body = srv.post("/generate", {"input_ids": p, "sampling_params": {
                "max_new_tokens": 2 * BLOCK, "temperature": 0.0, "custom_params": {"dllm": {"cache": cache}}}})
            assert status == 200, body
            assert_same(body["output_ids"], ref.reference(model, p, 2 * BLOCK), 2 * BLOCK)
