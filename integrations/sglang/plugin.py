"""The SGLang plugin (entry point ``sglang.srt.plugins: dllm``), run by SGLang's ``load_plugins()`` early in every
process; it changes no SGLang file: our algorithms, configs and model classes into SGLang's registries, and hooks
(``register``); ``patches/sglang/README.md`` has each hook and its reason."""
from __future__ import annotations

import importlib
import importlib.util

ARCHS = ("LLaDAModelLM", "DreamModel")
BLOCK_CAUSAL = "LLaDA2MoeModelLM"  # SGLang's own model class; its block size is the checkpoint's
GRAPHS_HOOK = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph"
STREAM_HOOK = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer.stream_output"


def register() -> None:
    """Entry point: register algorithms, configs and hooks (idempotent)."""
    from sglang.srt.dllm.algorithm import algo_name_to_cls
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .admission import HOOK as ADMISSION_HOOK, validate_request
    from .algorithm import ALGORITHMS, plain_forwards_only
    from .response import report_logprobs
    from dllm_core.models.hf_config import register_configs
    from .dtypes import EMBEDS_HOOK, drafter_launch_checks, embeds_in_runner_dtype
    from .spec import PREPARE_HOOK, adaptive_worker, prepare_decode

    register_configs()
    algo_name_to_cls.update((cls.__name__, cls) for cls in ALGORITHMS)
    init_new = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
    hooks = [("sglang.srt.dllm.config.DllmConfig.from_server_args", dllm_config, HookType.AROUND),
             ("sglang.srt.model_loader.utils.get_model_architecture", register_models, HookType.BEFORE),
             (init_new, add_request_info, HookType.AFTER),
             (EMBEDS_HOOK, embeds_in_runner_dtype, HookType.AFTER),
             ("sglang.srt.arg_groups.speculative_hook.handle_speculative_decoding", drafter_launch_checks,
              HookType.AFTER),
             (ADMISSION_HOOK, validate_request, HookType.AFTER),
             ("sglang.srt.speculative.spec_info.SpeculativeAlgorithm.create_worker", adaptive_worker, HookType.AFTER),
             (PREPARE_HOOK, prepare_decode, HookType.AROUND),
             (GRAPHS_HOOK, plain_forwards_only, HookType.AROUND), (STREAM_HOOK, report_logprobs, HookType.BEFORE)]
    for target, fn, kind in hooks:
        if not any(h is fn for _, h, _ in HookRegistry._hooks.get(target, [])):
            HookRegistry.register(target, fn, kind)
    if importlib.util.find_spec(f"{__package__}.tokenswift") is not None:  # sibling: TokenSwift speculative
        importlib.import_module(f"{__package__}.tokenswift").register()  # algorithm (last: its errors spare ours)


def register_models(*args, **kwargs) -> None:
    """BEFORE ``get_model_architecture``: put our model classes into SGLang's registry."""
    from sglang.srt.models.registry import ModelRegistry

    from .models import DreamModel, LLaDAModelLM

    for cls in (LLaDAModelLM, DreamModel):
        ModelRegistry.models[cls.__name__] = cls


def hf_config(server_args):
    """The served model's HF config (SGLang's ModelConfig: overrides applied)."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.configs.model_config import ModelConfig

    cfg = resolving_view(server_args)
    return ModelConfig.from_server_args(server_args, model_path=cfg.model_path, model_revision=cfg.revision).hf_config


def model_architecture(server_args, hf=None) -> str | None:
    """``architectures[0]`` of the served model's config (``hf``: that config, already read)."""
    return (getattr(hf or hf_config(server_args), "architectures", None) or [None])[0]


def dllm_config(original, server_args):
    """AROUND ``DllmConfig.from_server_args``: LLaDA-8B / Dream rows of the architecture table (others: SGLang's)."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.dllm.algorithm import get_algorithm_cls
    from .algorithm import DllmServeConfig
    from .options import read_yaml, with_default_cache

    cfg = resolving_view(server_args)
    if cfg.dllm_algorithm is None:
        return original(server_args)
    hf = hf_config(server_args)
    arch = model_architecture(server_args, hf)
    if arch not in ARCHS and arch != BLOCK_CAUSAL:
        return original(server_args)
    from dllm_core.engine.host_options import host_block_size
    from dllm_core.models.llada2 import BLOCK_SIZE, MASK_ID

    mask_id = getattr(hf, "mask_token_id", MASK_ID if arch == BLOCK_CAUSAL else None)
    if not isinstance(mask_id, int):
        raise ValueError(f"{arch}: config.json has no integer mask_token_id (LLaDA-8B: 126336, Dream: 151666); "
                         f"pass --json-model-override-args '{{\"mask_token_id\": ...}}'")
    algorithm_cls = get_algorithm_cls(cfg.dllm_algorithm)
    if algorithm_cls.supported_architectures and arch not in algorithm_cls.supported_architectures:
        raise ValueError(f"{cfg.dllm_algorithm} does not support model architecture {arch}")
    algorithm_config = with_default_cache(read_yaml(cfg.dllm_algorithm_config), arch in ARCHS)
    trained = getattr(hf, "block_size", BLOCK_SIZE) if arch == BLOCK_CAUSAL else None
    block_size = host_block_size(algorithm_config, trained, arch, "--dllm-algorithm-config")
    return DllmServeConfig(
        algorithm=cfg.dllm_algorithm, algorithm_config=algorithm_config, block_size=block_size, mask_id=mask_id,
        max_running_requests=1 if cfg.max_running_requests is None else cfg.max_running_requests,
        first_done_first_out_mode=cfg.dllm_fdfo,
        requires_separate_context_encoding=algorithm_cls.requires_separate_context_encoding,
        capture_input_preparation=(algorithm_cls.capture_input_preparation
                                   and algorithm_config.get("capture_input_preparation", True)))


def add_request_info(forward_batch, cls, batch, model_runner, *args, **kwargs):
    """AFTER ``ForwardBatch.init_new``: hand the algorithms (and a dllm-serve model) the batch's ``Req``s
    (references, no copies): a request's prompt ids and ``max_new_tokens`` (its response, its steps per block), and
    for Dream the token before its block."""
    if batch.dllm_config is None or not forward_batch.forward_mode.is_dllm_extend():
        return forward_batch
    from .response import BATCH

    BATCH.expect(forward_batch.req_pool_indices, batch.reqs, model_runner)
    return forward_batch

