#!/usr/bin/env bash
# Create .venv (if missing) and install ray_dhp with the given extras, CPU torch first; then put
# .venv/bin on PATH.
# Usage: source scripts/bootstrap.sh [extras]   (e.g. "test"; sourced: PATH is kept afterwards)
#        bash scripts/bootstrap.sh [extras]     (installs only)
# The caller's shell options are left as they were: the install runs in a subshell that stops at
# the first failing step (explicit `|| exit`: `set -e` is ignored inside an `if` condition), and
# a failure returns a non-zero status instead of closing the shell.
# RAY_DHP_VENV: the venv folder (default <repo>/.venv); PYTHON: the interpreter (default python3).

_ray_dhp_install() (
  root="$1" venv="$2" extras="$3"
  if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv" || exit 1
  fi
  stamp="$venv/.ray_dhp_installed${extras:+_$extras}"
  if [ ! -f "$stamp" ] || [ "$root/setup.cfg" -nt "$stamp" ]; then
    # torch pinned to 2.13.0 (where pip's find-links hold its CPU wheel, that wheel: a bare `torch`
    # requirement would pull a CUDA build); setup.cfg's range admits 2.13, so it is kept.
    # uv when it can be had (the same versions as pip, about 4x faster: ~45 s instead of ~150 s
    # on 2 cores); it does not read pip's configuration, so pip's find-links are handed to it.
    # --compile-bytecode as pip does: Ray's and multiprocessing's workers run `python -B`, so a
    # venv without .pyc files recompiles torch/transformers/ray in every worker (measured: the Ray
    # end-to-end tests 2x slower). pip otherwise, or if uv fails.
    if "$venv/bin/pip" install -q --disable-pip-version-check "uv>=0.5,<1" >/dev/null 2>&1 \
        && [ -x "$venv/bin/uv" ]; then
      links=()
      for d in ${PIP_FIND_LINKS:-} $("$venv/bin/pip" config get global.find-links 2>/dev/null); do
        links+=(--find-links "$d")
      done
      "$venv/bin/uv" pip install -q --compile-bytecode --python "$venv/bin/python" "${links[@]}" "torch==2.13.0" \
        -e "$root${extras:+[$extras]}" && { touch "$stamp"; exit 0; }
      echo "scripts/bootstrap.sh: uv could not install; using pip" >&2
    fi
    "$venv/bin/pip" install -q --disable-pip-version-check "torch==2.13.0" || exit 1
    "$venv/bin/pip" install -q --disable-pip-version-check -e "$root${extras:+[$extras]}" || exit 1
    touch "$stamp" || exit 1
  fi
)

_ray_dhp_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_ray_dhp_venv="${RAY_DHP_VENV:-$_ray_dhp_root/.venv}"
if _ray_dhp_install "$_ray_dhp_root" "$_ray_dhp_venv" "${1:-}"; then
  case ":$PATH:" in
    *":$_ray_dhp_venv/bin:"*) ;;
    *) export PATH="$_ray_dhp_venv/bin:$PATH" ;;
  esac
  _ray_dhp_status=0
else
  echo "scripts/bootstrap.sh: installing into $_ray_dhp_venv failed (see the messages above)" >&2
  _ray_dhp_status=1
fi
unset -f _ray_dhp_install
unset _ray_dhp_root _ray_dhp_venv
# `return` when sourced, `exit` when run as a script
return "$_ray_dhp_status" 2>/dev/null || exit "$_ray_dhp_status"
