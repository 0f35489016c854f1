"""TEST-ONLY: wait for a launched server's ``/health``, or fail fast with what it was doing.

Both harnesses (``sglang_harness/server.py``, ``vllm_harness/jobs.py``) launch a server in its own process
group and call ``wait_healthy``. A probe waits at most ``PROBE_S`` for an answer (a server that accepts the
connection and never answers costs one probe, not the request timeout), and the whole wait is bounded by the
deadline: a server that is not healthy by then is stopped and its tests fail with ``ServerNotHealthy``, whose
message holds the process list and the log's tail.
"""
from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

DEADLINE_S = 110.0  # the default start-up budget: a stuck launch fails well inside 120 s, stop included
PROBE_S = 2.0


class ServerNotHealthy(TimeoutError):
    """The server did not answer ``/health`` with 200 before its deadline; ``log`` holds its output."""

    def __init__(self, what: str, deadline_s: float, procs: str, log: str):
        super().__init__(f"{what} not healthy after {deadline_s:.0f} s; its processes:\n{procs}\n"
                         f"log ({len(log)} chars), last lines:\n{log[-4000:]}")
        self.log = log


class ServerExited(RuntimeError):
    """The server process ended before it was healthy; ``log`` holds its output."""

    def __init__(self, what: str, code: int, log: str):
        super().__init__(f"{what} exited with {code}:\n{log[-4000:]}")
        self.code, self.log = code, log


def read_log(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def process_list(pid: int) -> str:
    """``ps`` of the process group ``pid`` leads (a launch and every process it started)."""
    return subprocess.run(["ps", "-o", "pid,stat,etime,pcpu,rss,cmd", "-g", str(pid)], capture_output=True,
                          text=True).stdout


def probe(url: str, timeout: float = PROBE_S) -> int | None:
    """The HTTP status of ``GET url`` (None: no answer within ``timeout`` or no connection)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):  # refused, reset, timed out (socket.timeout is an OSError)
        return None


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, what: str, deadline_s: float = DEADLINE_S,
                 gave_up=lambda: False) -> bool:
    """Poll ``url + "/health"`` until it answers 200 (True). ``gave_up()`` True (for instance: the port was
    taken before the server bound it) -> False. The process ending -> ``ServerExited``; the deadline passing ->
    ``ServerNotHealthy`` (the caller stops the process)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerExited(what, proc.returncode, read_log(log))
        if probe(url + "/health", min(PROBE_S, max(0.1, deadline - time.monotonic()))) == 200:
            return True
        if gave_up():
            return False
        time.sleep(0.5)
    raise ServerNotHealthy(what, deadline_s, process_list(proc.pid), read_log(log))
