"""The test harnesses' launch guard: a server whose ``/health`` never answers (a stand-in process that accepts
connections and never replies) fails its tests at the deadline with the harness's own error, its process list
and the log's tail, instead of holding the run for the request timeout."""
import sys
import time

import pytest

from health import DEADLINE_S, PROBE_S, ServerNotHealthy

# binds the port after --port, accepts every connection, never answers
STAND_IN = """import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1]))); s.listen(16)
print("stand-in: listening, never answering", flush=True)
held = []
while True:
    held.append(s.accept()[0])
"""
DEADLINE = 6.0


def stand_in(port: int) -> list[str]:
    return [sys.executable, "-c", STAND_IN, "--port", str(port)]


def test_the_default_deadline_fails_a_launch_inside_120_s():
    assert DEADLINE_S + PROBE_S + 1.0 <= 120


def test_sglang_server_that_never_answers_fails_at_its_deadline(tmp_path):
    from sglang_harness.server import SGLangServer

    srv = SGLangServer("unused", log=tmp_path / "server.log", startup_s=DEADLINE)
    srv.command = stand_in(srv.port)
    t0 = time.monotonic()
    with pytest.raises(ServerNotHealthy) as err:
        srv.start()
    assert time.monotonic() - t0 < DEADLINE + PROBE_S + 5
    msg = str(err.value)
    assert f"SGLang server not healthy after {DEADLINE:.0f} s" in msg, msg
    assert "stand-in: listening, never answering" in msg and "its processes" in msg and "-c" in msg, msg
    assert srv.proc.poll() is not None  # stopped, not left behind


def test_vllm_server_that_never_answers_fails_at_its_deadline(tmp_path, monkeypatch):
    import subprocess

    from vllm_harness import jobs

    started = []

    def fake_start(model, port, *flags, tiny=True):
        with open(jobs.server_log(port), "w") as out:
            started.append(subprocess.Popen(stand_in(port), stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True))
        return started[-1]

    monkeypatch.setattr(jobs, "start_server", fake_start)
    t0 = time.monotonic()
    with pytest.raises(ServerNotHealthy, match="vLLM server not healthy after 6 s") as err:
        with jobs.serving(tmp_path, timeout=DEADLINE):
            pass
    assert time.monotonic() - t0 < DEADLINE + PROBE_S + 5
    assert "stand-in: listening, never answering" in str(err.value)
    assert started[0].poll() is not None


def test_a_failing_engine_job_reports_its_traceback_and_its_process_ends(tmp_path):
    """An engine job forked from the harness's zygote that raises fails its test with the job's own traceback (from
    its log), and the job's process is gone; the zygote takes the next job."""
    pytest.importorskip("vllm")
    from vllm_harness.jobs import ZYGOTES, finish_engine, start_engine

    missing = tmp_path / "no-such-model"
    job = start_engine({"model": str(missing), "engine": {}, "batches": []}, v2=False)
    with pytest.raises(RuntimeError, match="vLLM engine failed") as err:
        finish_engine(job, timeout=120)
    assert "Traceback" in str(err.value) and str(missing) in str(err.value)
    assert job.poll() is not None and ZYGOTES.proc.poll() is None
    again = start_engine({"model": str(missing), "engine": {}, "batches": []}, v2=False)
    assert again.pid != job.pid
    with pytest.raises(RuntimeError, match="vLLM engine failed"):
        finish_engine(again, timeout=120)
