import pytest
import torch

from dllm_core import load_model
from dllm_core.testing import build_tiny_checkpoint

# tiny models: one intra-op thread is ~100x faster than two on a busy 2-core machine (thread hand-off
# dominates microsecond kernels); engine subprocesses set their own threads
torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Re-assert one thread per module: an in-process vLLM engine may have changed it."""
    torch.set_num_threads(1)


@pytest.fixture
def both_cores():
    """Two intra-op threads for one test whose matmuls are large (a shipped model over 16+ rows of 250-1,000
    positions: 1.5x faster on 2 cores), one again after it."""
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def llada_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("llada"), "llada")


@pytest.fixture(scope="session")
def dream_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("dream"), "dream")


@pytest.fixture(scope="session")
def llada2_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("llada2"), "llada2")


@pytest.fixture(scope="session")
def llada(llada_dir):
    return load_model(llada_dir)


@pytest.fixture(scope="session")
def dream(dream_dir):
    return load_model(dream_dir)


@pytest.fixture(scope="session", params=["llada", "dream"])
def model(request):
    return request.getfixturevalue(request.param)


PROMPTS = [[25, 26, 27, 28, 29, 21, 33], [30, 31, 32], [40, 41, 42, 43, 44]]


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run @pytest.mark.slow tests")


HOSTS = ("vllm", "sglang")  # a test file named after a host holds that host's tests: ``pytest -m vllm`` runs them


def pytest_collection_modifyitems(config, items):
    for item in items:
        for host in HOSTS:
            if host in item.path.name:
                item.add_marker(getattr(pytest.mark, host))
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: pass --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# --- fixture set-up times (module / session fixtures: server launches, engine jobs, references) -----------
_FIXTURE_SETUP: list[tuple[float, str, str]] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    import time

    t0 = time.perf_counter()
    yield
    dt = time.perf_counter() - t0
    if fixturedef.scope in ("module", "session", "package") and dt >= 1.0:
        param = getattr(request, "param", None)
        name = fixturedef.argname + (f"[{param}]" if param is not None else "")
        _FIXTURE_SETUP.append((dt, fixturedef.scope, f"{request.node.nodeid.split('::')[0]}::{name}"))


def pytest_terminal_summary(terminalreporter):
    """The slowest module / session fixture set-ups (a server launch or a recorded job is paid here, once)."""
    if not _FIXTURE_SETUP:
        return
    terminalreporter.section("slowest fixture set-ups (module / session scope, >= 1 s)")
    for dt, scope, name in sorted(_FIXTURE_SETUP, reverse=True)[:25]:
        terminalreporter.write_line(f"{dt:8.2f}s {scope:8s} {name}")
    total = sum(dt for dt, _, _ in _FIXTURE_SETUP)
    terminalreporter.write_line(f"{total:8.2f}s in all ({len(_FIXTURE_SETUP)} set-ups)")
