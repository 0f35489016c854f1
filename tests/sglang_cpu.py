"""TEST-ONLY: a CPU stand-in for SGLang's scheduler + model runner, for tests without a GPU.

Everything below the scheduler is SGLang's own: the model is built and its weights loaded by
SGLang's model loader (``get_model``), attention runs through ``RadixAttention`` and SGLang's
``TorchNativeAttnBackend`` over a real ``MHATokenToKVPool`` / ``ReqToTokenPool``, and a block is
decoded by the algorithm's real ``DllmAlgorithm.run`` loop. What is replaced: process groups
(one gloo rank), request admission and KV-slot allocation (``BlockDriver``: contiguous slots, no
radix sharing), CUDA graphs and the GPU kernels.

The driver follows SGLang's dLLM block layout: blocks are aligned to multiples of
``block_size`` (``dllm_block_offset``); full prompt blocks are prefilled one block per round, and
the block holding the prompt tail is the first one denoised.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

_READY = False


def init_cpu_runtime() -> None:
    """World-size-1 process groups on gloo + published server args, as SGLang layers need them
    (the steps of ``sglang.test.layer_ut_utils.init_single_process_dist``, on a free port)."""
    global _READY
    if _READY:
        return
    import socket

    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (init_distributed_environment, initialize_model_parallel,
                                                       model_parallel_is_initialized)
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    if parallel_state._WORLD is None:  # reuses torch.distributed if someone initialized it already
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
    if not model_parallel_is_initialized():
        reset_context()
        publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1), role="test",
                ranks=SpawnRanks(world_rank=0))
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
        initialize_model_parallel(backend="gloo")
    scale_cpu_moe_output()
    _READY = True


def scale_cpu_moe_output() -> None:
    """SGLang's CPU MoE paths (``UnquantizedFusedMoEMethod.forward_cpu``: ``moe_forward_native`` and AMX's
    ``fused_experts_cpu``) drop the ``routed_scaling_factor`` its GPU runners apply to the routed experts'
    output (Triton ``fused_experts(routed_scaling_factor=...)``), so a model with a factor (LLaDA2: 2.5)
    computes another function on CPU. This stand-in applies it as the GPU path does (idempotent; the class
    aliases ``forward_native`` to ``forward_cpu``, which is what its CPU dispatch calls)."""
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

    orig = UnquantizedFusedMoEMethod.forward_cpu
    if getattr(orig, "dllm_scaled", False):
        return

    def forward_cpu(self, layer, dispatch_output):
        out = orig(self, layer, dispatch_output)
        f = self.moe_runner_config.routed_scaling_factor
        if f is not None and f != 1.0 and not layer.should_fuse_routed_scaling_factor_in_topk:
            out.hidden_states.mul_(f)
        return out

    forward_cpu.dllm_scaled = True
    UnquantizedFusedMoEMethod.forward_cpu = UnquantizedFusedMoEMethod.forward_native = forward_cpu  # the alias too


def load_sglang_model(model_dir, dtype: str = "float32"):
    """Build the registered model class for ``model_dir`` and load its weights with SGLang's
    ``DefaultModelLoader`` (safetensors iterator -> ``model.load_weights``) on CPU."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import get_model

    init_cpu_runtime()
    mc = ModelConfig(str(model_dir), trust_remote_code=False, dtype=dtype)
    return get_model(model_config=mc, load_config=LoadConfig(load_format="safetensors"),
                     device_config=DeviceConfig("cpu"))


@dataclass
class Row:
    """One request: committed tokens (prompt + output) and its dLLM progress."""

    prompt: list[int]
    gen_len: int
    slot: int
    out: list[int] = field(default_factory=list)
    kv_len: int = 0  # positions whose K/V are frozen in the paged cache
    state: object = None  # carried algorithm state (FDFO)
    block: list[int] | None = None  # the block in flight (FDFO)
    sampling: dict = field(default_factory=dict)  # the request's SGLang sampling parameters (custom_params: ours)

    @property
    def committed(self) -> list[int]:
        return self.prompt + self.out


class CpuRunner:
    """The model-runner surface ``DllmAlgorithm.run`` uses (``forward``, ``model``) + request
    slots in a real ``ReqToTokenPool`` (contiguous token slots per request)."""

    def __init__(self, model=None, max_len: int = 512, max_reqs: int = 8):
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        self.model, self.device, self.max_len, self.forwards = model, "cpu", max_len, 0
        self.req_to_token_pool = ReqToTokenPool(max_reqs, max_len, "cpu", False)

    def alloc_slot(self) -> int:
        slot = self.req_to_token_pool.alloc_rows(1)[0]  # bumps the slot generation, like an admission
        base = 1 + (slot - 1) * self.max_len
        self.req_to_token_pool.req_to_token[slot] = torch.arange(base, base + self.max_len, dtype=torch.int32)
        return slot

    def free_slot(self, slot: int) -> None:
        self.req_to_token_pool.free_rows([slot])

    def forward(self, fb, pp_proxy_tensors=None):
        raise NotImplementedError


class CpuModelRunner(CpuRunner):
    """Runs an SGLang model: ``MHATokenToKVPool`` + ``TorchNativeAttnBackend`` under SGLang's
    forward context."""

    def __init__(self, model, max_len: int = 512, max_reqs: int = 8):
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        from sglang.srt.layers.radix_attention import RadixAttention

        super().__init__(model, max_len, max_reqs)
        atts = [m for m in model.modules() if isinstance(m, RadixAttention)]  # ours or SGLang's own model
        dtype = next(model.parameters()).dtype
        self.token_to_kv_pool = MHATokenToKVPool(max_reqs * max_len + 1, 1, dtype, atts[0].tp_k_head_num,
                                                 atts[0].head_dim, len(atts), "cpu", False)
        self.backend = TorchNativeAttnBackend(self)

    def forward(self, fb, pp_proxy_tensors=None):
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        self.forwards += 1
        if (prepare := getattr(self.model, "prepare_for_forward", None)) is not None:  # as SGLang's runner
            prepare(fb)
        with forward_context(ForwardContext(attn_backend=self.backend)):
            self.backend.init_forward_metadata(fb)
            out = self.model(fb.input_ids, fb.positions, fb)
        return SimpleNamespace(logits_output=out, can_run_graph=False)


class BlockDriver:
    """Runs requests through ``algorithm.run`` block by block, like SGLang's dLLM scheduler."""

    def __init__(self, algorithm, runner: CpuRunner, block_size: int | None = None):
        self.algo, self.runner, self.L = algorithm, runner, block_size or algorithm.block_size
        self.rows: list[Row] = []  # the last generate()'s requests (slots, outputs)

    def batch(self, rows: list[Row], blocks: list[list[int]], prompt_mask: bool = False):
        """A DLLM_EXTEND ``ForwardBatch`` holding one block per row at its KV frontier."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
        from sglang.srt.sampling.sampling_params import SamplingParams

        from integrations.sglang.plugin import add_request_info

        B, L, r2t = len(rows), self.L, self.runner.req_to_token_pool.req_to_token
        starts = [r.kv_len for r in rows]
        pos = torch.tensor([s + i for s in starts for i in range(L)])
        seq = torch.tensor([s + L for s in starts])
        fb = ForwardBatch(forward_mode=ForwardMode.DLLM_EXTEND, batch_size=B,
                          input_ids=torch.tensor(sum(blocks, []), dtype=torch.long),
                          req_pool_indices=torch.tensor([r.slot for r in rows]), seq_lens=seq,
                          out_cache_loc=torch.cat([r2t[r.slot, s:s + L].long() for r, s in zip(rows, starts)]),
                          seq_lens_sum=int(seq.sum()))
        fb.positions, fb.seq_lens_cpu = pos, seq.clone()
        fb.extend_prefix_lens = torch.tensor(starts, dtype=torch.int32)
        fb.extend_seq_lens = torch.full((B,), L, dtype=torch.int32)
        fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, fb.extend_num_tokens = list(starts), [L] * B, B * L
        if prompt_mask:  # what SGLang sets when a committed token is a literal mask id
            fb.dllm_prompt_mask = pos.view(B, L) < torch.tensor([len(r.committed) for r in rows])[:, None]
        # the plugin's ForwardBatch.init_new hooks, on the ScheduleBatch / Req fields they read
        reqs = [SimpleNamespace(dllm_block_offset=s, full_untruncated_fill_ids=r.committed, origin_input_ids=r.prompt,
                                output_ids=list(r.out), sampling_params=SamplingParams(max_new_tokens=r.gen_len,
                                                                                       **r.sampling))
                for r, s in zip(rows, starts)]
        sb = SimpleNamespace(dllm_config=True, reqs=reqs)
        add_request_info(fb, ForwardBatch, sb, self.runner)
        return fb

    def _blocks(self, rows: list[Row], mask_id: int):
        """Each row's block at its KV frontier: the block in flight, a full prompt block to
        prefill, or the committed tail + masks."""
        blocks = []
        for r in rows:
            tail = r.committed[r.kv_len:r.kv_len + self.L]
            blocks.append(list(r.block) if r.block is not None else tail + [mask_id] * (self.L - len(tail)))
        return blocks

    def generate(self, prompts: list[list[int]], gen_len: int, mask_id: int, prompt_mask: bool = False,
                 max_rounds: int = 1000, outputs: list[list[int]] | None = None,
                 sampling: list[dict] | None = None) -> list[list[int]]:
        """Decode ``gen_len`` tokens after each prompt. Like SGLang, a round either prefills full
        prompt blocks or denoises (one ``algorithm.run``: the whole block in the synchronous mode,
        one step in ``first_done_first_out_mode``). Slots are freed at the end. ``outputs``: tokens
        each request committed before (a retracted request re-admitted: re-prefilled with its prompt); ``sampling``:
        each request's SGLang sampling parameters (``custom_params``: its dllm options)."""
        outputs = outputs or [[] for _ in prompts]
        sampling = sampling or [{} for _ in prompts]
        rows = self.rows = [Row(list(p), gen_len, self.runner.alloc_slot(), list(o), sampling=sp)
                            for p, o, sp in zip(prompts, outputs, sampling)]
        try:
            for _ in range(max_rounds):
                live = [r for r in rows if len(r.out) < r.gen_len]
                if not live:
                    return [r.out[:r.gen_len] for r in rows]
                self._round([r for r in live if len(r.committed) - r.kv_len >= self.L] or live, mask_id, prompt_mask)
            raise RuntimeError("BlockDriver: too many rounds")
        finally:
            for r in rows:
                self.runner.free_slot(r.slot)

    def _round(self, batch: list[Row], mask_id: int, prompt_mask: bool) -> None:
        fb = self.batch(batch, self._blocks(batch, mask_id), prompt_mask)
        fdfo = self.algo.fdfo
        _, ids, accept, states, _ = self.algo.run(self.runner, fb, [r.state for r in batch] if fdfo else None)
        for i, r in enumerate(batch):
            n_prompt = min(self.L, len(r.committed) - r.kv_len)  # committed tokens inside the block
            if fdfo:
                if accept[i] == 0:  # unresolved: carried to the next round
                    r.block, r.state = list(ids[i]), states[i]
                    continue
                r.block = r.state = None
                new = list(ids[i])[n_prompt:]
            else:
                new = ids[i].tolist() if ids else []
            r.out += new
            r.kv_len += self.L
