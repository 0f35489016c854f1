"""GPU-path check (one command on a CUDA machine): on tiny local checkpoints loaded on cuda,

1. every exact cache mode reproduces `none` token for token and batched rows equal unbatched runs, for every sampler;
2. every registered policy gives the same tokens with its CUDA graphs on as off (the embedded engine);
3. a whole-response host's cached step (the core's ``PackedStep``: plan regions, V-verify picks, recomputed rows to a
   bucket, packed attention; SGLang's path) captured as one CUDA graph and replayed equals the eager step: hidden
   states, stored features and work (Elastic: each of its two passes captured, the step's one read between them).

    python scripts/gpu_check.py [cuda]      # exit status 1 on any mismatch
"""
import sys
import tempfile

import torch

from dllm_core import GenerationConfig, generate, load_model
from dllm_core.testing import PackedHostStep, build_tiny_checkpoint

PROMPTS = [[25, 26, 27, 28, 29, 21, 33], [30, 31, 32], [40, 41, 42, 43, 44]]
SAMPLERS = ["low_confidence", "threshold:tau=0.6", "factor", "slowfast", "entropy"]
POLICIES = ["none", "prefix", "dual", "dllm:kp=3,kr=2,rho=0.25", "canvas:kr=2", "dpad:window=8,decay=none,tail=4",
            "elastic:gamma=0.9"]
HOST = ["prefix", "dual", "dllm:kp=3,kr=2,rho=0.25", "dllm:kp=3,kr=2,rho=0.25,unit=tokens",
        "dpad:window=4,decay=none,tail=1", "elastic:gamma=0.9", "elastic:gamma=0.9999,probe=1"]  # (this one refreshes)


def exact_modes(m, arch: str) -> int:
    bad = 0
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
    return bad


def graphs_equal_eager(m, arch: str) -> int:
    bad = 0
    cfg = GenerationConfig(gen_length=32, block_length=8, steps=16, sampler="threshold:tau=0.6")
    for spec in POLICIES:
        off = spec + (",graphs=false" if ":" in spec else ":graphs=false")
        ok = torch.equal(generate(m, PROMPTS, cfg, cache=spec).tokens, generate(m, PROMPTS, cfg, cache=off).tokens)
        bad += not ok
        print(f"{arch:6s} {spec:34s} graphs==eager={'ok' if ok else 'MISMATCH'}")
    return bad


def captured(f, graphs: list):
    """``f`` run as a CUDA graph: captured once (its Python runs once, as eagerly), then replayed."""
    def call(*args):
        graphs.append(torch.cuda.CUDAGraph())
        with torch.cuda.graph(graphs[-1]):
            out = f(*args)
        graphs[-1].replay()
        return out
    return call


def passes_captured(m, arch: str, spec: str, buckets: bool = False) -> int:
    """A step with a test after each layer (Elastic): its passes captured (``run_layers(wrap=...)``, the kernels warmed
    by the policies before it) against a twin step run eagerly."""
    (ref, h), graphs = (PackedHostStep(m, spec, "cuda", buckets=buckets) for _ in range(2)), []
    spec += " (buckets)" * buckets
    with torch.no_grad():
        want = ref.run(ref.x)
        try:
            out = h.run(h.x, lambda f: captured(f, graphs))
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (reported: a policy that cannot be captured)
            print(f"{arch:6s} host step {spec:34s} NOT CAPTURED: {type(e).__name__}: {str(e).splitlines()[0]}")
            return 1
    ok = torch.equal(out, want) and all(torch.equal(a, b) for a, b in zip(h.features(), ref.features())) and \
        torch.equal(h.step.work(), ref.step.work())
    print(f"{arch:6s} host step {spec:34s} passes captured ({len(graphs)})==eager={'ok' if ok else 'MISMATCH'}")
    return int(not ok)


def host_step_captured(m, arch: str) -> int:
    """Each policy's whole-response host step captured as one CUDA graph, as served and padded to the bucket set."""
    bad = 0
    for spec, buckets in [(s, b) for b in (False, True) for s in HOST]:
        if spec.startswith("elastic"):
            bad += passes_captured(m, arch, spec, buckets)
            continue
        h = PackedHostStep(m, spec, "cuda", buckets=buckets)
        spec += " (buckets)" * buckets
        with torch.no_grad():
            snap, x = h.features(), h.x.clone()
            ref, feats, work = h.run(x).clone(), h.features(), h.step.work().clone()
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up outside the capture
                    h.load(snap)
                    h.run(x)
                torch.cuda.current_stream().wait_stream(side)
                h.load(snap)
                h.step.tally.zero_()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = h.run(x)
                graph.replay()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 (reported: a policy that cannot be captured)
                print(f"{arch:6s} host step {spec:34s} NOT CAPTURED: {type(e).__name__}: {str(e).splitlines()[0]}")
                bad += 1
                torch.cuda.synchronize()
                continue
            ok = torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(h.features(), feats)) and \
                torch.equal(h.step.work(), work)
            bad += not ok
            print(f"{arch:6s} host step {spec:34s} captured==eager={'ok' if ok else 'MISMATCH'}")
    return bad


def main(device: str = "cuda") -> int:
    bad = 0
    for arch in ("llada", "dream"):
        m = load_model(build_tiny_checkpoint(tempfile.mkdtemp(), arch), device, torch.float32)
        for check in (exact_modes, graphs_equal_eager, host_step_captured):
            try:
                bad += check(m, arch)
            except Exception as e:  # noqa: BLE001 (one failing check does not hide the others' results)
                bad += 1
                print(f"{arch:6s} {check.__name__} FAILED: {type(e).__name__}: {e}")
    print(f"GPU check: {bad} mismatches")
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
