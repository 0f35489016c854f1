"""One GenerationConfig (and so one sampler and one cache policy instance) shared by concurrent
requests: policies are immutable descriptions, every request gets its own state."""
from concurrent.futures import ThreadPoolExecutor

import pytest

from dllm_core import GenerationConfig, generate
from conftest import PROMPTS

POLICIES = ["none", "prefix", "dual", "prefix:every=2", "dllm:kp=4,kr=2,rho=0.25", "dllm:kp=3,kr=2,select=random",
            "canvas", "canvas:kr=2,rho=0.5"]


@pytest.mark.parametrize("cache", POLICIES)
def test_four_threads_sharing_one_config_equal_sequential(model, cache):
    cfg = GenerationConfig(gen_length=16, block_length=8, steps=8, sampler="slowfast", cache=cache)
    jobs = [[p] for p in PROMPTS] + [PROMPTS] + [[p] for p in reversed(PROMPTS)]  # 7 requests, one batched
    want = [generate(model, j, cfg).tokens.tolist() for j in jobs]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(2):
            got = list(pool.map(lambda j: generate(model, j, cfg).tokens.tolist(), jobs))
            assert got == want
