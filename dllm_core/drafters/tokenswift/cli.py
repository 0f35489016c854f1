"""``dllm train-tokenswift`` and ``dllm bench-long`` (registered through ``cli.SUBCOMMANDS``)."""
from __future__ import annotations


def add_parser(sub) -> None:
    from . import bench, train

    train.add_parser(sub)
    bench.add_parser(sub)
