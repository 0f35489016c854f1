"""GPU-path check (run on a CUDA machine): on tiny local checkpoints loaded on cuda, every exact cache
mode reproduces `none` token for token and batched rows equal unbatched runs, for every sampler."""
import sys
import tempfile

import torch

from dllm_core import GenerationConfig, generate, load_model
from dllm_core.testing import build_tiny_checkpoint

PROMPTS = [[25, 26, 27, 28, 29, 21, 33], [30, 31, 32], [40, 41, 42, 43, 44]]
SAMPLERS = ["low_confidence", "threshold:tau=0.6", "factor", "slowfast", "entropy"]


def main(device: str = "cuda") -> int:
    bad = 0
    for arch in ("llada", "dream"):
        m = load_model(build_tiny_checkpoint(tempfile.mkdtemp(), arch), device, torch.float32)
        for s in SAMPLERS:
            cfg = GenerationConfig(gen_length=16, block_length=8, steps=8, sampler=s)
            base = generate(m, PROMPTS, cfg)
            for c in ("prefix:every=1", "dual:every=1", "dllm:kp=1,kr=1"):
                ok = torch.equal(generate(m, PROMPTS, cfg, cache=c).tokens, base.tokens)
                bad += not ok
                print(f"{arch:6s} {s:18s} {c:16s} exact={'ok' if ok else 'MISMATCH'}")
            for c in ("none", "prefix", "dual"):
                b = generate(m, PROMPTS, cfg, cache=c).tokens
                ok = all(torch.equal(generate(m, [p], cfg, cache=c).tokens[0], b[i]) for i, p in enumerate(PROMPTS))
                bad += not ok
                print(f"{arch:6s} {s:18s} {c:16s} batched==unbatched={'ok' if ok else 'MISMATCH'}")
    print(f"GPU check: {bad} mismatches")
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
