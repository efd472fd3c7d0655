#!/usr/bin/env bash
# Build the side virtual environments holding the peers' own code, OUTSIDE the repository.
#
# Usage: tools/build_peer_venvs.sh [--with-trl-grpo] [CLOSURE ...]
#   CLOSURE is one of: verl-openrlhf trl skyrl-areal trl-grpo (default: the first three), or the name
#   of a closure kept in the repository, tools/peers/closures/NAME.txt (peers beyond shared/peers).
#
# Environment:
#   REFPPO_PEERS_ROOT  where the venvs go            (default /work/peervenv)
#   REFPPO_PEERS_DIR   where the pinned closures are (default ../shared/peers, relative to the repo;
#                      a relative value is taken from the repo root)
#   PYTHON311          the interpreter to build from (default python3.11)
#
# Each venv: `python3.11 -m venv ROOT/NAME`, `pip install torch==2.13.0` (CPU wheel, pinned), then
# `pip install --no-deps -r CLOSURE.txt`, then `touch ROOT/NAME/READY`. Idempotent: a venv whose
# READY stamp is newer than its closure file is left alone; a half-built one is rebuilt.
# See the closures' README (shared/peers/README.md) for why --no-deps and which imports to stub.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root="${REFPPO_PEERS_ROOT:-/work/peervenv}"
if [ -n "${REFPPO_PEERS_DIR:-}" ]; then
    dir="$REFPPO_PEERS_DIR"
    case "$dir" in /*) ;; *) dir="$repo/$dir" ;; esac
else
    # ../shared/peers next to the checkout (/work/main); from a worktree (/work/wt/NAME) the
    # shared folder is two levels up, and a checkout may carry shared/ inside itself.
    dir="$repo/../shared/peers"
    for d in "$repo/../shared/peers" "$repo/../../shared/peers" "$repo/shared/peers"; do
        if [ -d "$d" ]; then dir="$d"; break; fi
    done
fi
py="${PYTHON311:-python3.11}"
torch_spec="torch==2.13.0"

closures=()
grpo=0
for arg in "$@"; do
    case "$arg" in
        --with-trl-grpo) grpo=1 ;;
        verl-openrlhf | trl | skyrl-areal | trl-grpo) closures+=("$arg") ;;
        *)
            if [ -f "$repo/tools/peers/closures/$arg.txt" ]; then
                closures+=("$arg")
            else
                echo "build_peer_venvs.sh: unknown closure or flag '$arg'" >&2; exit 2
            fi ;;
    esac
done
[ "${#closures[@]}" -eq 0 ] && closures=(verl-openrlhf trl skyrl-areal)
[ "$grpo" -eq 1 ] && closures+=(trl-grpo)

command -v "$py" >/dev/null || { echo "build_peer_venvs.sh: $py not found" >&2; exit 2; }
mkdir -p "$root"

build() {
    local name="$1" req="$dir/$1.txt" env="$root/$1"
    [ -f "$repo/tools/peers/closures/$1.txt" ] && req="$repo/tools/peers/closures/$1.txt"
    [ -f "$req" ] || { echo "build_peer_venvs.sh: closure file $req not found" >&2; return 2; }
    if [ -f "$env/READY" ] && [ "$env/READY" -nt "$req" ]; then
        echo "[$name] ready: $env"
        return 0
    fi
    echo "[$name] building in $env"
    rm -f "$env/READY"
    [ -x "$env/bin/python" ] || "$py" -m venv "$env"
    "$env/bin/python" -m pip install -q "$torch_spec"
    local extra=()
    # skyrl-train 0.3.1 and skyrl 0.4.0 declare Python 3.12 only, oat-llm 0.2.4 < 3.11; their files run on
    # 3.11 (shared/peers/README.md, the closure headers).
    case "$name" in skyrl-areal | skyrl04 | oat) extra=(--ignore-requires-python) ;; esac
    "$env/bin/python" -m pip install -q --no-deps "${extra[@]}" -r "$req"
    # The peer side imports refppo inside the peer's interpreter (tools/peers/makers/trl_ppo.py: its task,
    # capture adapter, dump writer; tools/peers adapters: refppo.capture.adapters): jaxtyping is refppo's
    # one import the closures may lack (versions as tools/constraints.txt).
    if ! "$env/bin/python" -c "import jaxtyping" 2>/dev/null; then
        "$env/bin/python" -m pip install -q --no-deps jaxtyping==0.3.11 wadler_lindig==0.1.8
    fi
    "$env/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '2.13.0', torch.__version__"
    touch "$env/READY"
    echo "[$name] ready: $env"
}

status=0
for c in "${closures[@]}"; do
    build "$c" || status=$?
done
exit "$status"
