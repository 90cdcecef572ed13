#!/bin/sh
# Prints the pip index URL to install torch from, for the Dockerfile's torch build args.
#
#   torch_index_url.sh VARIANT [CUDA_TAG] [OVERRIDE]
#
# VARIANT: cpu (the CPU-only wheel: no CUDA libraries in the image) or cuda (the CUDA build
# for CUDA_TAG, e.g. cu128; its CUDA runtime comes as pip packages, the driver from the node).
# OVERRIDE: an index URL that wins over both (the TORCH_INDEX_URL build arg), when non-empty.
# Anything else is refused with a message naming the value, so a typo fails the build instead
# of silently installing another torch.
set -eu
variant="${1:-}"
cuda_tag="${2:-cu128}"
override="${3:-}"
if [ -n "$override" ]; then
    echo "$override"
    exit 0
fi
case "$variant" in
    cpu) echo "https://download.pytorch.org/whl/cpu" ;;
    cuda)
        case "$cuda_tag" in
            cu[0-9][0-9]*) echo "https://download.pytorch.org/whl/$cuda_tag" ;;
            *) echo "TORCH_CUDA must look like cu128, got '$cuda_tag'" >&2; exit 2 ;;
        esac ;;
    *) echo "TORCH_VARIANT must be cpu or cuda, got '$variant'" >&2; exit 2 ;;
esac
