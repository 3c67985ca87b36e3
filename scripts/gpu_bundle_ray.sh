#!/usr/bin/env bash
# .gpu-ray/ (git-ignored): the device machine's packages for the Ray runs of issue #15 — fla, transformers
# 5.24 (glmkit's config classes; the image has 5.17), and Ray
# with its dependencies (the GPU image has none of Ray) — small enough to travel (the tree is capped
# at 64 MiB: Ray's wheel unpacks to 220 MB, so the parts a local Ray core run never imports go: Java
# jars, rllib, data, serve, llm, tune, train; 27 MB packed). Same layout as ../shared/tools/gpu-bundle:
#
#   bash scripts/gpu_bundle_ray.sh      then on the device: carry [".gpu-ray"], begin with: source .gpu-ray/prelude.sh &&
#
# The versions are the CPU venv's (constraints/cpu.txt).
set -euo pipefail
top=$(git rev-parse --show-toplevel)
pins="fla-core==0.6.0 flash-linear-attention==0.6.0 ray==2.60.0 click==8.5.1 jsonschema==4.26.0
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 msgpack==1.2.4
  protobuf==7.36.2 PyYAML==6.0.4 requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1
  charset-normalizer==3.5.3 idna==3.20 filelock==4.3.2 packaging==26.4 transformers==5.24.0"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
# the tool writes .gpu/ at a checkout's top: run it in a scratch clone, then trim and repack here
git clone -q "$top" "$work/clone"
(cd "$work/clone" && GPU_BUNDLE_PINS="$(echo $pins)" "$top/../shared/tools/gpu-bundle")
mkdir "$work/site"
xz -dc "$work/clone/.gpu/site.tar.xz" | tar -C "$work/site" -xf -
rm -rf "$work"/site/ray/{jars,rllib,data,serve,llm,tune,train}
# the bundle tool drops file modes; Ray starts these two as programs
chmod +x "$work"/site/ray/core/src/ray/gcs/gcs_server "$work"/site/ray/core/src/ray/raylet/raylet
rm -rf "$top/.gpu-ray" && mkdir "$top/.gpu-ray"
cp "$work/clone/.gpu/key" "$work/clone/.gpu/prelude.sh" "$work/clone/.gpu/wheels.txt" "$top/.gpu-ray/"
tar -C "$work/site" -cf - . | xz -9 -T0 > "$top/.gpu-ray/site.tar.xz"
echo "wrote .gpu-ray ($(du -sh "$top/.gpu-ray" | cut -f1)); carry [\".gpu-ray\"], begin with: source .gpu-ray/prelude.sh &&"
