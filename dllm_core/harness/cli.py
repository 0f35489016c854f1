"""``dllm-lm-eval`` / ``python -m dllm_core.harness``: lm-eval's own command line (``lm_eval``, all its
subcommands and flags) with ``--model dllm`` registered and, unless ``--include_path`` is given, the shipped
task directory on it. lm-eval 0.4.13 reads no plugin entry points, so its ``lm_eval`` executable alone cannot
find a model defined outside its source tree; releases that read them need no wrapper (``__init__.py``)."""
from __future__ import annotations

import sys

from . import TASKS_DIR, register

def with_tasks(argv: list[str]) -> list[str]:
    """``argv`` with ``--include_path TASKS_DIR`` added where the command takes one and none is given."""
    if any(a == "--include_path" or a.startswith("--include_path=") for a in argv):
        return argv
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "run" and len(argv) == 1):
        return argv
    return [*argv, "--include_path", str(TASKS_DIR)]


def main(argv: list[str] | None = None) -> None:
    """Run lm-eval's CLI on ``argv`` (None: the process's arguments) with the dllm model and tasks."""
    from lm_eval.__main__ import cli_evaluate

    register()
    args = list(sys.argv[1:] if argv is None else argv)
    sys.argv = ["lm-eval", *with_tasks(args)]
    cli_evaluate()


if __name__ == "__main__":
    main()
