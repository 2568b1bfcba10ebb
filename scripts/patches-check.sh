#!/bin/sh
# Whether patches/series still applies to llama-cpp-python VERSION's source release (default: the
# pin, patches/PIN), without building anything: downloads the sdist (pip download --no-binary),
# then tries each patch in order with `git apply --check` on the tree the earlier ones made. A
# patch that applies is applied, so the next is tried as the build would try it; one that does
# not is reported with the files and hunks that fail, and its hunks that do apply are applied
# (git apply --reject) so the rest are still tried: a later failure may be a knock-on.
# Exit 0 if every patch applies, 1 if any does not, 2 if the release could not be fetched.
# Usage: [PYTHON=python3] scripts/patches-check.sh [VERSION]
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
. "$ROOT/scripts/patches.sh"
VERSION=${1:-$PIN}
PYTHON=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT INT TERM
echo "llama-cpp-python $VERSION: fetching its source release"
if ! "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
  "llama-cpp-python==$VERSION" -d "$tmp" >"$tmp/pip.log" 2>&1; then
  grep -v '^WARNING: Location' "$tmp/pip.log" | tail -n 3 >&2
  echo "patches-check: cannot download llama-cpp-python==$VERSION's sdist" >&2
  exit 2
fi
sdist=$(ls "$tmp"/*.tar.gz)
mkdir "$tmp/src"
tar xzf "$sdist" -C "$tmp/src"
src=$(ls -d "$tmp"/src/*/)
echo "checking patches/series ($(echo "$SERIES" | wc -l | tr -d ' ') patches, written for $PIN) in order"
failed=0
for p in $SERIES; do
  patch="$ROOT/patches/$p"
  if (cd "$src" && git apply --check -p1 "$patch" >/dev/null 2>&1); then
    (cd "$src" && git apply -p1 "$patch")
    echo "  ok    $p"
  else
    failed=$((failed + 1))
    echo "  FAIL  $p"
    # Which files and hunks: git apply --reject applies what it can and says what it cannot.
    (cd "$src" && git apply -p1 --reject "$patch" 2>&1 || true) |
      sed -n -e 's/^error: patch failed: \(.*\)/          patch failed: \1/p' \
        -e 's/^error: \(.*\): No such file or directory/          missing file: \1/p' \
        -e 's/^Applying patch \(.*\) with \([0-9]*\) rejects*\.*$/          \1: \2 hunk(s) rejected/p' |
      sed "s|$src||g"
  fi
done
total=$(echo "$SERIES" | wc -l | tr -d ' ')
if [ "$failed" -eq 0 ]; then
  echo "llama-cpp-python $VERSION: all $total patches apply"
else
  echo "llama-cpp-python $VERSION: $failed of $total patches do not apply (a FAIL after another" \
    "may be a knock-on of it; patches/series' 'needs' lines say which rest on which)"
  exit 1
fi
