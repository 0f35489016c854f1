"""TEST-ONLY harness: run SGLang 0.5.23's real server runtime on a CPU (see README.md).

Put this directory on ``PYTHONPATH`` of the server process (``server.py`` does); Python imports
``sitecustomize`` at start-up in every process, SGLang's spawned scheduler and detokenizer included.
Nothing in site-packages is edited. What it does:

1. ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's CPU engine) unless already set;
2. ``import sgl_kernel`` finds the pure-torch stand-in next to this file (no CPU wheel is published);
3. each module in ``CHANGES`` is compiled from its own source with the listed text replacements, when it
   is first imported; a replacement whose text is not found exactly once stops the import with an error
   naming the module (the harness is pinned to SGLang 0.5.23).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

# module -> [(why, old text, new text)]
CHANGES: dict[str, list[tuple[str, str, str]]] = {
    "sglang.srt.arg_groups.speculative_hook": [(
        "DFLASH's device check knows CUDA / NPU / XPU only; the CPU engine runs its worker too",
        'cfg.device.startswith("cuda") or cfg.device == "npu" or cfg.device == "xpu"',
        'cfg.device.startswith("cuda") or cfg.device in ("npu", "xpu", "cpu")',
    )],
    "sglang.srt.arg_groups.choices": [(
        "the draft model's attention backend may be torch_native (every other choice needs GPU kernels)",
        'DRAFT_ATTENTION_BACKEND_CHOICES = [\n',
        'DRAFT_ATTENTION_BACKEND_CHOICES = [\n    "torch_native",\n',
    )],
    "sglang.srt.speculative.dflash_worker_v2": [(
        "CPU tensors have no streams: Tensor.record_stream is a CUDA-only call",
        "        batch.seq_lens.record_stream(",
        "        if batch.seq_lens.is_cuda:\n            batch.seq_lens.record_stream(",
    ), (
        "(the indented argument line of the call above)",
        "            torch.get_device_module(self.device).current_stream()\n        )\n\n        bs = len(batch.seq_lens)",
        "                torch.get_device_module(self.device).current_stream()\n            )\n\n"
        "        bs = len(batch.seq_lens)",
    )],
    "sglang.srt.models.dflash": [(
        "the fused QK-norm + RoPE table kernel of the DFlash draft attention is Triton-only",
        "            not _is_npu\n            and not self.use_gemma_norm",
        "            not _is_npu\n            and self.rotary_emb.cos_sin_cache.is_cuda\n"
        "            and not self.use_gemma_norm",
    )],
    "sglang.srt.layers.quantization.unquant": [(
        "the CPU MoE path drops routed_scaling_factor, which SGLang's GPU runners apply to the routed experts' "
        "output (LLaDA2: 2.5); without it the model computes another function on CPU",
        "                topk_output,\n                moe_runner_config,\n            )\n"
        "            return StandardCombineInput(hidden_states=output)",
        "                topk_output,\n                moe_runner_config,\n            )\n"
        "            factor = moe_runner_config.routed_scaling_factor\n"
        "            if factor not in (None, 1.0) and not layer.should_fuse_routed_scaling_factor_in_topk:\n"
        "                output = output * factor\n"
        "            return StandardCombineInput(hidden_states=output)",
    )],
    "sglang.srt.entrypoints.engine": [(
        "the scheduler and detokenizer processes are forked, not spawned: a spawned process imports SGLang again "
        "(15 s of a 30 s launch on 2 cores); on a CPU there is no CUDA context a fork could inherit",
        '    mp.set_start_method("spawn", force=True)',
        '    mp.set_start_method("fork", force=True)',
    )],
    "sglang.srt.layers.attention.torch_native_backend": [(
        "the torch-native backend has no TARGET_VERIFY mode (speculative verification, DFlash's draft block): "
        "such a batch carries no extend_* lengths; target_verify.py attends each request's new tokens to its "
        "prefix and among themselves (tree mask, chain or, for non-causal layers, all)",
        "        self._run_sdpa_forward_extend(\n            q_,\n            o_,\n",
        "        if forward_batch.forward_mode.is_target_verify():\n"
        "            from target_verify import target_verify_sdpa\n\n"
        "            target_verify_sdpa(q_, o_, self.token_to_kv_pool.get_key_buffer(layer.layer_id),\n"
        "                               self.token_to_kv_pool.get_value_buffer(layer.layer_id),\n"
        "                               self.req_to_token_pool.req_to_token, forward_batch, layer.scaling, use_gqa,\n"
        "                               causal)\n"
        "            return o\n"
        "        self._run_sdpa_forward_extend(\n            q_,\n            o_,\n",
    )],
    "sglang.srt.utils.common": [(
        "SGLang registers its Python custom ops (BitsAndBytes' apply_bnb_4bit, ...) for the CUDA key only; the CPU "
        "engine calls them with CPU tensors",
        '            my_lib.impl(op_name, op_func, "CUDA")',
        '            my_lib.impl(op_name, op_func, "CUDA")\n            my_lib.impl(op_name, op_func, "CPU")',
    )],
    "sglang.srt.model_loader.loader": [(
        "BitsAndBytes' in-flight quantization moves each weight to CUDA first; bitsandbytes (>= 0.46) quantizes on "
        "the CPU",
        "                    loaded_weight = weight_sub_tensor.cuda()",
        "                    loaded_weight = weight_sub_tensor",
    )],
}


class _ChangedSourceLoader(importlib.machinery.SourceFileLoader):
    """Compiles the module from its source with the harness's replacements applied (no bytecode cache)."""

    def get_code(self, fullname):
        source = self.get_source(fullname)
        for why, old, new in CHANGES[fullname]:
            count = source.count(old)
            if count != 1:
                raise ImportError(f"tests/sglang_harness: change to {fullname} ({why}) expects its text once, "
                                  f"found {count} times: this harness is pinned to SGLang 0.5.23")
            source = source.replace(old, new)
        return compile(source, self.path, "exec", dont_inherit=True)


class _HarnessFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in CHANGES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        spec.loader = _ChangedSourceLoader(name, spec.origin)
        return spec


sys.meta_path.insert(0, _HarnessFinder())
