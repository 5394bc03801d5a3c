#!/usr/bin/env bash
# The image's entry point. Usage:
#   docker run IMAGE repro [DVC ARGS]      dvc repro (the whole pipeline, or the stages named)
#   docker run IMAGE flow [FLOW ARGS]      python -m flows.pipeline (Prefect, temporary server)
#   docker run IMAGE retrain [ARGS]        python -m flows.retrain (needs PREFECT_API_URL)
#   docker run IMAGE stage NAME            python -m stages.NAME, without DVC (e.g. on the
#                                          worker nodes of a multi-node run)
#   docker run IMAGE help                  this text
#   docker run IMAGE COMMAND [ARGS]        anything else runs as given (dvc, torchrun, bash)
#
# The working directory is the project: the copy baked into the image, or your
# checkout mounted over /workspace (`-v "$PWD:/workspace"`).
set -euo pipefail

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }

# A checkout mounted from the host is a git repository and DVC uses it as one.
# The copy baked into the image has no .git (see .dockerignore), and DVC refuses
# to work there unless told that this project has no SCM; .dvc/config.local is
# git-ignored by DVC, so a mounted checkout never sees this setting.
if [[ -d .dvc ]] && ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    dvc config --local core.no_scm true
fi

verb=${1:-help}
[[ $# -gt 0 ]] && shift
case "$verb" in
    repro)   exec dvc repro "$@" ;;
    flow)    exec python -m flows.pipeline "$@" ;;
    retrain) exec python -m flows.retrain "$@" ;;
    stage)
        if [[ $# -lt 1 || ! "$1" =~ ^[A-Za-z0-9_]+$ ]]; then
            echo "usage: stage NAME (one of: $(cd stages && ls -- *.py | grep -v '^__' | sed 's/\.py$//' | tr '\n' ' '))" >&2
            exit 2
        fi
        name=$1; shift
        exec python -m "stages.$name" "$@" ;;
    help|-h|--help) usage ;;
    *)       exec "$verb" "$@" ;;
esac
