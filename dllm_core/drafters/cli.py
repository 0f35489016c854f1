"""``dllm train-dflash`` and ``dllm bench-dflash`` (registered through ``cli.SUBCOMMANDS``)."""
from __future__ import annotations


def add_parser(sub) -> None:
    from ..train import dflash as train_dflash
    from . import bench

    train_dflash.add_parser(sub)
    bench.add_parser(sub)
