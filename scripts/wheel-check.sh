#!/usr/bin/env bash
# CI step: builds the eagle-check wheel (maturin, release), installs it into a fresh virtual
# environment and runs the shipped default bundle from there (`eagle-check run
# fixtures/bundles/tiny-llama`, exit 0 expected).
#
# Needs cargo, python3 and PyPI, nothing else:
# - maturin comes from PyPI into its own venv (a binary wheel; where PyPI has none for the
#   platform, pip builds it with the cargo that is here anyway);
# - a venv on a python3 without ensurepip (Debian/Ubuntu without python3-venv) is made with
#   virtualenv from PyPI instead;
# - pip is upgraded in each venv: maturin tags the wheel manylinux_2_X (PEP 600), which a pip
#   older than 20.3 refuses as "not a supported wheel on this platform".
# Python: $EAGLE_CHECK_PYTHON, else python3. Cargo's target directory: $CARGO_TARGET_DIR, else
# target/ (the release build is shared with `cargo build --release`).
set -euo pipefail
cd "$(dirname "$0")/.."

py=${EAGLE_CHECK_PYTHON:-python3}
work=target/wheel-check
rm -rf "$work"
mkdir -p "$work"

# A virtual environment with an up-to-date pip at $1.
new_venv() {
    if ! { "$py" -m venv "$1" && [ -x "$1/bin/pip" ]; } 2>/dev/null; then
        rm -rf "$1"
        echo "wheel-check.sh: $py -m venv has no pip here; using virtualenv from PyPI" >&2
        "$py" -m pip install --quiet --target "$work/virtualenv" virtualenv
        PYTHONPATH="$work/virtualenv" "$py" -m virtualenv --quiet "$1"
    fi
    "$1/bin/python" -m pip install --quiet --upgrade pip
}

new_venv "$work/build"
"$work/build/bin/python" -m pip install --quiet "maturin>=1.5,<2"
CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target} \
    "$work/build/bin/maturin" build --release --out "$work/dist"
wheels=("$work"/dist/eagle_check-*.whl)
[ "${#wheels[@]}" -eq 1 ] || {
    echo "wheel-check.sh: expected one wheel in $work/dist, found ${#wheels[@]}" >&2
    exit 1
}
echo "wheel-check.sh: built ${wheels[0]}"

# A fresh venv holding nothing but the wheel: from here on no Rust toolchain is used.
new_venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --no-index "${wheels[0]}"
# shellcheck disable=SC1091
. "$work/venv/bin/activate"
found=$(command -v eagle-check)
[ "$found" = "$PWD/$work/venv/bin/eagle-check" ] || {
    echo "wheel-check.sh: eagle-check on PATH is $found, not the venv's" >&2
    exit 1
}
want="eagle-check $(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)"
got=$(eagle-check --version)
[ "$got" = "$want" ] || {
    echo "wheel-check.sh: --version says '$got', Cargo.toml '$want'" >&2
    exit 1
}
eagle-check run fixtures/bundles/tiny-llama
echo "wheel-check.sh: ok ($got from ${wheels[0]##*/}, installed in $work/venv)"
