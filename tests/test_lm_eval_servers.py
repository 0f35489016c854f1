"""lm-evaluation-harness against our vLLM server (issue 35.2): lm-eval's OpenAI-compatible ``local-completions``
model pointed at the server (the ``--dllm-*`` launcher, CPU harness), the per-request dllm options passed through
``--gen_kwargs '{"vllm_xargs": {...}}'``: the server route gives the embedded route's answers (``--model dllm``)
on the shipped task data. SGLang's routes: tests/test_sglang_server.py, tests/test_sglang_server_spec.py."""
import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("vllm")

from lm_eval_routes import CANVAS, embedded, served  # noqa: E402
from vllm_harness.jobs import ROOT, serving  # noqa: E402

LLADA = ROOT / "models" / "llada-tasks"

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not (LLADA / "config.json").is_file(), reason="models/llada-tasks not shipped")]


@pytest.fixture(scope="module")
def vllm_server():
    with serving(LLADA, tiny=False) as url:
        yield url


# (embedded policy, the server's): the vanilla loop is Fast-dLLM's prefix cache refreshed every step on a host
@pytest.mark.parametrize("sampler, cache, served_cache", [("low_confidence", "none", "prefix:every=1"),
                                                          ("threshold:tau=0.9", "dual", "dual")])
def test_vllm_server_route_equals_the_embedded_route(vllm_server, sampler, cache, served_cache):
    want = embedded(LLADA, **CANVAS, sampler=sampler, cache=cache)
    xargs = {"dllm_sampler": sampler, "dllm_cache": served_cache, "dllm_block_length": CANVAS["block_length"]}
    assert served(vllm_server, LLADA, {"vllm_xargs": xargs}) == want
