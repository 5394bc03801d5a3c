#!/usr/bin/env bash
# Usage: image-constraints.sh CONSTRAINTS OUT [TORCH_INDEX_URL]
#
# Writes OUT: the pins of CONSTRAINTS with its torch pin replaced by the torch
# that is installed in this image, so that `pip install -c OUT .` keeps that
# torch and never swaps a CUDA build for another one.
#
# On a CUDA PyTorch base image torch is already there and is kept as it is. On a
# plain Python image there is none: the version pinned in CONSTRAINTS is
# installed first from TORCH_INDEX_URL (the CPU wheel index by default), because
# the default index's Linux wheel of the same version is the CUDA build, several
# GB that a CPU image has no use for.
set -euo pipefail

constraints=${1:?usage: image-constraints.sh CONSTRAINTS OUT [TORCH_INDEX_URL]}
out=${2:?usage: image-constraints.sh CONSTRAINTS OUT [TORCH_INDEX_URL]}
index=${3:-https://download.pytorch.org/whl/cpu}
python=${PYTHON:-python}

installed() {
    "$python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null
}

if ! version=$(installed); then
    pin=$(grep -E '^torch[[:space:]]*==' "$constraints" | head -n 1 | tr -d '[:space:]' || true)
    if [[ -z "$pin" ]]; then
        echo "image-constraints: no torch in the image and no torch== pin in $constraints" >&2
        exit 1
    fi
    echo "image-constraints: installing $pin from $index" >&2
    "$python" -m pip install --no-cache-dir --index-url "$index" "$pin"
    version=$(installed)
fi

{
    echo "# generated from $constraints by docker/image-constraints.sh"
    grep -vE '^torch[[:space:]]*([=<>!~;[]|$)' "$constraints" || true
    echo "torch==$version"
} > "$out"
echo "image-constraints: keeping torch==$version" >&2
