"""``python -m dllm_core.harness ...``: see ``cli.py``."""
from .cli import main

main()
