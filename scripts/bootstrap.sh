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
    # torch first, pinned to the CPU wheel (a bare `torch` requirement would pull a CUDA build);
    # setup.cfg's range admits 2.13, so the next step keeps it.
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
