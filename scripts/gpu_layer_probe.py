"""One LLaDA-8B-shaped layer's cached step (Fast-dLLM ``dual``: the block's 32 rows against a K/V buffer of
prompt + response, written in place) on a GPU, replayed as a CUDA graph: the embedded ``Block`` eager, and the same
``Block`` through ``torch.compile`` (inductor fuses RMSNorm, RoPE, SwiGLU and the residuals). Prints ms per layer
and x 32 layers against the floor (the layer's weights read once at 4.8 TB/s), at batch 1 and 16.

    PYTHONPATH=. python scripts/gpu_layer_probe.py      # about 1 min on an H200
"""
import torch

from dllm_core.models.layers import Block, RotaryEmbedding
from dllm_core.models.transformer import LLaDAModelLM
from dllm_core.stepbench import LLADA_8B

ROWS, T, LAYERS = 32, 2176, 32


def timed(fn, n: int = 50) -> float:
    """ms per call of ``fn`` captured once as a CUDA graph (warm-up outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main() -> None:
    args = LLaDAModelLM.parse_config(LLADA_8B)
    dev, dt = torch.device("cuda"), torch.bfloat16
    with torch.device(dev):
        block = Block(args).to(dt)
        rope_mod = RotaryEmbedding(args.head_dim, args.rope_theta).to(dev)
    with torch.no_grad():
        for n, p in block.named_parameters():
            p.fill_(1.0) if n.endswith("norm.weight") else p.normal_(0, 0.02)
    wbytes = sum(p.numel() * p.element_size() for p in block.parameters())
    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    print(f"layer weights {wbytes / 2**20:.0f} MiB; floor {1e3 * wbytes / 4.8e12:.3f} ms per layer "
          f"({LAYERS * 1e3 * wbytes / 4.8e12:.2f} ms x {LAYERS})")
    for B in (1, 16):
        x = torch.randn(B, ROWS, args.dim, device=dev, dtype=dt)
        kv = [torch.randn(B, args.n_kv_heads, T, args.head_dim, device=dev, dtype=dt) for _ in range(2)]
        pos = torch.arange(T - 128, T - 128 + ROWS, device=dev).expand(B, ROWS)
        rope = rope_mod(pos, dt)
        with torch.no_grad():
            ref = block(x, rope, None, kv=kv, at=T - 128)
            got = compiled(x, rope, None, kv=kv, at=T - 128)
            err = (got.float() - ref.float()).abs().max().item()
            e = timed(lambda: block(x, rope, None, kv=kv, at=T - 128))
            c = timed(lambda: compiled(x, rope, None, kv=kv, at=T - 128))
        floor = 1e3 * (wbytes + B * 2 * T * args.n_kv_heads * args.head_dim * 2) / 4.8e12
        print(f"batch {B:2d}: eager graph {e:.3f} ms/layer ({LAYERS * e:.2f} x {LAYERS}), compiled graph {c:.3f} "
              f"({LAYERS * c:.2f}); floor {floor:.3f} ({LAYERS * floor:.2f}); efficiency {floor / e:.2f} -> "
              f"{floor / c:.2f}; max |compiled - eager| {err:.3g}")


if __name__ == "__main__":
    main()
