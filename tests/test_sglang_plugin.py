"""The SGLang plugin: discovered through the ``sglang.srt.plugins`` entry point by SGLang's own
loader in a fresh process, and launch-time validation through SGLang's real server-args
resolution (``ServerArgs.resolve_once`` -> ``handle_dllm_inference`` -> the algorithm's
``configure_server_args`` and the ``DllmConfig`` architecture table)."""
import json
import os
import subprocess
import sys
import textwrap

from types import SimpleNamespace

import pytest

pytest.importorskip("sglang.srt.dllm.algorithm")

from dllm_core.testing import build_tiny_checkpoint  # noqa: E402
from sglang.srt.arg_groups.overrides import resolving_view  # noqa: E402
from sglang.srt.dllm.algorithm import algo_name_to_cls, get_algorithm  # noqa: E402
from sglang.srt.dllm.config import DllmConfig  # noqa: E402
from integrations.sglang.prefix_row import last_prefix_ids  # noqa: E402
from sglang.srt.model_executor.cuda_graph_config import Backend  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

OURS = ["DllmCore", "FastDllmFactor", "FastDllmThreshold", "SlowFast"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    load_plugins()
    return {a: str(build_tiny_checkpoint(tmp_path_factory.mktemp(f"plug_{a}"), a)) for a in ("llada", "dream")}


def test_entry_point_registers_everything_in_a_fresh_process(ckpt, tmp_path):
    """A new interpreter, SGLang's ``load_plugins()``: algorithms, hooks and configs are live."""
    (tmp_path / "a.yaml").write_text("block_size: 16\nk: 4\n")
    code = textwrap.dedent(f"""
        import json
        from sglang.srt.dllm.algorithm import algo_name_to_cls
        before = sorted(algo_name_to_cls)
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.arg_groups import speculative_hook
        from sglang.srt.dllm.config import DllmConfig
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.model_loader import utils
        from sglang.srt.server_args import ServerArgs
        from transformers import AutoConfig
        cfg = DllmConfig.from_server_args(ServerArgs(model_path={ckpt['dream']!r}, dllm_algorithm="SlowFast",
                                                     dllm_algorithm_config={str(tmp_path / 'a.yaml')!r}))
        print(json.dumps(dict(
            before=before, after=sorted(algo_name_to_cls),
            module=algo_name_to_cls["SlowFast"].__module__,
            wrapped=[hasattr(f, "__wrapped__") for f in (DllmConfig.from_server_args, ForwardBatch.init_new,
                                                           utils.get_model_architecture,
                                                           ModelRunner._extend_forward_kwargs,
                                                           speculative_hook.handle_speculative_decoding)],
            config=type(AutoConfig.from_pretrained({ckpt['llada']!r})).__name__,
            dllm=[cfg.algorithm, cfg.block_size, cfg.mask_id, cfg.algorithm_config])))
    """)
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert not set(OURS) & set(got["before"])
    assert set(OURS) <= set(got["after"]) and "LowConfidence" in got["after"]
    assert got["module"] == "integrations.sglang.algorithm"
    assert got["wrapped"] == [True] * 5
    assert got["config"] == "LLaDAConfig"
    mask = json.load(open(os.path.join(ckpt["dream"], "config.json")))["mask_token_id"]
    assert got["dllm"] == ["SlowFast", 16, mask, {"block_size": 16, "k": 4, "cache": "dual"}]  # the default policy


def resolved(model, algo, yaml_text, tmp_path, **kw):
    (tmp_path / "algo.yaml").write_text(yaml_text)
    sa = ServerArgs(model_path=model, dllm_algorithm=algo, dllm_algorithm_config=str(tmp_path / "algo.yaml"),
                    device="cpu", **kw)
    sa.resolve_once()
    return sa


def graphs_off(sa) -> list[bool]:
    g = resolving_view(sa).cuda_graph_config
    return [g.decode.backend == Backend.DISABLED, g.prefill.backend == Backend.DISABLED]


def test_launch_llada_with_dllm_cache(ckpt, tmp_path, caplog):
    """LLaDA-8B through SGLang's launch resolution: our architecture row (block size from the
    YAML, mask id from config.json, page size aligned to it); dLLM-Cache keeps SGLang's CUDA graphs (its
    cached forwards run eager by ``plain_forwards_only``); the scheduler-side algorithm is built from the same
    config."""
    sa = resolved(ckpt["llada"], "SlowFast", "block_size: 8\nk: 4\ncache: 'canvas:kr=3,rho=0.25'\n", tmp_path)
    assert graphs_off(sa)[0] is False
    assert "CUDA graphs disabled" not in caplog.text
    assert resolving_view(sa).page_size == 8
    cfg = DllmConfig.from_server_args(sa)
    mask = json.load(open(os.path.join(ckpt["llada"], "config.json")))["mask_token_id"]
    assert (cfg.block_size, cfg.mask_id) == (8, mask)
    assert cfg.validate_request(SimpleNamespace(origin_input_ids=[3, 4])) is None
    assert cfg.validate_request(SimpleNamespace(origin_input_ids=[3, mask, 4])) == \
        f"prompts must not contain the mask token id {mask} (found at position 1)"  # admission: HTTP 400
    algo = get_algorithm(cfg)
    assert type(algo) is algo_name_to_cls["SlowFast"]
    assert (algo.sampler.k, algo.opts.cache.kr, algo.opts.cache.rho) == (4, 3, 0.25)


def test_launch_graphs_stay_on_for_llada_and_dream(ckpt, tmp_path, caplog):
    """(SGLang captures dLLM blocks in the decode phase; prefill graphs are off by default.) SGLang's block
    canvas keeps them, asked for by name, for Dream too (its prefix rows are made before the forward,
    ``test_sglang_models``)."""
    for arch in ("llada", "dream"):
        assert graphs_off(resolved(ckpt[arch], "FastDllmThreshold", "tau: 0.8\ncache: canvas\n", tmp_path))[0] is False
    assert "CUDA graphs disabled" not in caplog.text


def test_no_cache_option_serves_the_whole_response(ckpt, tmp_path):
    """Defaults never lose quality: with no cache option our model classes decode the whole response as one
    canvas (Fast-dLLM's dual cache: the embedded engine's semantics), never chained block canvases."""
    sa = resolved(ckpt["llada"], "FastDllmThreshold", "tau: 0.8\n", tmp_path)
    assert graphs_off(sa)[0] is False and resolving_view(sa).disable_radix_cache
    cfg = DllmConfig.from_server_args(sa)
    assert cfg.options().policy.name == "dual" and cfg.algorithm_config["cache"] == "dual"
    assert type(get_algorithm(cfg).whole).__name__ == "ResponseHost"


def test_a_launch_file_reads_floats_without_a_dot_as_numbers(tmp_path):
    """``1e-06`` (how ``json.dumps`` writes small floats; YAML 1.2's floats) is a number in a launch file, as 0.001
    is; quoted, it stays a string."""
    from dllm_core.engine.host_options import read_mapping

    f = tmp_path / "a.json"
    f.write_text(json.dumps({"margin": 1e-06, "tau": 0.5, "n": 3, "name": "1e-3x"}))
    assert read_mapping(str(f), "--x") == {"margin": 1e-06, "tau": 0.5, "n": 3, "name": "1e-3x"}
    f.write_text("margin: 1e-3\nk: -2E+2\nname: '1e-3'\nsize: 12\n")
    got = read_mapping(str(f), "--x")
    assert got == {"margin": 0.001, "k": -200.0, "name": "1e-3", "size": 12} and type(got["size"]) is int


BAD = [("SlowFast", "k: 0", r"SlowFast\.k must be >= 1, got 0"),
       ("SlowFast", "tau: 0.5", r"SlowFast has no option 'tau'; allowed: \[.*'high', 'k', 'k_fast'.*'temperature'"),
       ("SlowFast", "stat: median", r"SlowFast\.stat must be one of \['std', 'var'\], got 'median'"),
       ("SlowFast", "high: yes", r"SlowFast\.high must be a number, got True"),
       ("FastDllmThreshold", "tau: 1.5", r"FastDllmThreshold\.tau must be in \[0\.0, 1\.0\], got 1\.5"),
       ("FastDllmThreshold", "tau: high", r"FastDllmThreshold\.tau must be a number, got 'high'"),
       ("FastDllmFactor", "f: 0", r"FastDllmFactor\.f must be > 0, got 0"),
       ("FastDllmThreshold", "cache: 'canvas:rho=2'", r"FastDllmThreshold\.cache\.rho must be in \[0\.0, 1\.0\]"),
       ("FastDllmThreshold", "cache: 'canvas:kp=50'",
        r"cache: canvas has no option 'kp'; allowed: \['first_layer', 'kr', 'metric', 'rho', 'seed', 'select'\]"),
       ("FastDllmThreshold", "cache: 'canvas:blocks=2'",  # SGLang's canvas is one block
        r"cache: canvas has no option 'blocks'; allowed: \['first_layer', 'kr', 'metric', 'rho', 'seed', 'select'\]"),
       ("FastDllmThreshold", "cache: 'canvas:select=query'",
        r"cache\.select must be one of \['key', 'random', 'value'\]"),
       ("FastDllmThreshold", "dllm_cache: {kr: 3, rho: 0.25}",  # the spelling before 0.2
        r"FastDllmThreshold\.dllm_cache: renamed in 0\.2 to FastDllmThreshold\.cache with vLLM's spelling: "
        r"cache: \"canvas:kr=3,rho=0\.25\""),
       ("DllmCore", "sampler: nope", r"DllmCore\.sampler: --sampler: unknown policy 'nope'; allowed: \[.*'slowfast'"),
       ("DllmCore", "sampler: 'slowfast:k=x'", r"DllmCore\.sampler: .*cannot parse 'x' as int"),
       ("DllmCore", "steps: 0", r"steps must be >= 1, got 0"),
       ("SlowFast", "temperature: -1", r"temperature must be >= 0, got -1"),
       ("SlowFast", "[1, 2]", r"must hold a YAML mapping, got list"),
       ("SlowFast", "block_size: 0", r"block_size must be an integer >= 1, got 0")]


@pytest.mark.parametrize("algo,text,message", BAD, ids=[f"{a}-{t}" for a, t, _ in BAD])
def test_bad_options_fail_at_launch(ckpt, tmp_path, algo, text, message):
    with pytest.raises(ValueError, match=message):
        resolved(ckpt["llada"], algo, text + "\n", tmp_path)


def test_dllm_cache_refusals(ckpt, tmp_path):
    """dLLM-Cache needs one of our model classes: refused at launch otherwise. Under tensor parallelism it is no
    longer refused: its picks are made from sums over every rank's heads (``tests/test_tensor_parallel.py``)."""
    (tmp_path / "c.yaml").write_text("cache: 'canvas:kr=2'\n")
    args = dict(dllm_algorithm="SlowFast", dllm_algorithm_config=str(tmp_path / "c.yaml"))
    algo_name_to_cls["SlowFast"].configure_server_args(ServerArgs(model_path=ckpt["llada"], tp_size=2, **args))
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                                                  "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
                                                  "intermediate_size": 128, "vocab_size": 320}))
    with pytest.raises(ValueError, match=r"SlowFast\.cache: canvas needs one of the dllm-serve models "
                                         r"\['LLaDAModelLM', 'DreamModel'\], got Qwen2ForCausalLM"):
        algo_name_to_cls["SlowFast"].configure_server_args(ServerArgs(model_path=str(qwen), **args))


def test_last_prefix_ids_come_from_the_batchs_requests():
    """Dream's model reads the token before each block from the batch's ``Req``s (the plugin's
    ``ForwardBatch.init_new`` hook hands them over): position ``dllm_block_offset - 1`` of the fill ids."""
    reqs = [SimpleNamespace(dllm_block_offset=o, full_untruncated_fill_ids=list(range(100, 140))) for o in (0, 8, 32)]
    assert last_prefix_ids(reqs, [1, 2]) == [107, 131]


def test_admission_names_what_a_diffusion_decode_does_not_do():
    """The fields SGLang's /generate may carry that a diffusion decode does not honour are refused by name
    (the core's reasons), and prompt ids past the vocabulary are refused on every server."""
    from types import SimpleNamespace

    from dllm_core.engine.request import NOT_DECODED, not_decoded_error
    from dllm_core.engine.step import token_range_error
    from integrations.sglang.admission import asked

    req = lambda sp=None, **kw: SimpleNamespace(sampling_params={"max_new_tokens": 8, **(sp or {})}, **kw)
    assert asked(req({"temperature": 0.0, "n": 1, "repetition_penalty": 1.0, "regex": None})) == {}
    assert asked(req({"n": 3})) == {"samples": "sampling_params.n"}
    assert asked(req(return_logprob=True)) == {}  # (a diffusion decode reports them; SGLang's path not yet: 400)
    assert asked(req({"json_schema": "{}", "regex": "a"})) == {"grammar": "sampling_params.regex"}
    assert asked(req({"min_new_tokens": 2, "presence_penalty": 0.5})) == {
        "min_tokens": "sampling_params.min_new_tokens", "penalties": "sampling_params.presence_penalty"}
    assert set(NOT_DECODED) == {"samples", "grammar", "min_tokens", "penalties"}
    assert not_decoded_error({}) is None
    assert not_decoded_error({"samples": "sampling_params.n"}).startswith(
        "sampling_params.n: a diffusion decode does not do several answers per request")
    assert token_range_error([0, 5, 511], 512) is None
    assert token_range_error([3, 512], 512) == ("prompt token ids must be in [0, 512) (the model's vocabulary), "
                                                "got 512 at position 1")
    assert "got -1 at position 0" in token_range_error([-1], 512)
