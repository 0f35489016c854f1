"""lm-eval task configs (YAML) and their data (JSONL) for the task suite; the ``lm_eval.tasks`` entry point
names this package, and ``--include_path`` can name its directory."""
