# Sourced by scripts/build-llama.sh and scripts/patches-check.sh (POSIX sh): the pinned
# llama-cpp-python version (patches/PIN) and patches/series' patch names, in order.
# shellcheck shell=sh
ROOT=${ROOT:-$(cd "$(dirname "$0")/.." && pwd)}
PIN=$(tr -d ' \t\r\n' < "$ROOT/patches/PIN")
# One patch a line; '#' lines (each patch's notes) and blank lines are not patches.
SERIES=$(sed -e '/^[[:space:]]*#/d' -e '/^[[:space:]]*$/d' "$ROOT/patches/series")
