#!/usr/bin/env bash
# Builds, from scratch, a Python 3.13 venv with MaxText 0.2.5 installed as its users install
# it (no backports, no --ignore-requires-python), for experiments/maxtext_probe.py:
#
#   bash experiments/maxtext_env.sh [PYTHON3.13] [VENV]
#     PYTHON3.13  default /opt/py313/bin/python3.13 (.ci/python313 prints or builds one)
#     VENV        default .venv313-maxtext at the repository root (recreated: --clear)
#   then: VENV/bin/python experiments/maxtext_probe.py --out DIR  (imports MaxText as installed)
#
# Network: the two `pip install` steps, each under `timeout`; the rest is local.
#
# What goes in: maxtext==0.2.5 itself, jax/jaxlib 0.12.0.1 (CPU), and the packages that
# MaxText's decoder imports (maxtext.configs.pyconfig, maxtext.models.models,
# maxtext.utils.maxtext_utils, maxtext.utils.sharding: what maxtext_probe.py uses) with
# everything they need, at versions the `cuda12` extra asks for, less its CUDA packages
# (jax-cuda12-plugin/-pjrt, nvidia-*, cuda-bindings, cuda-pathfinder, transformer-engine*).
# Then this project, editable, without its dependencies (it allows jax < 0.13).
#
# Where the pins come from. `pip download --no-deps maxtext==0.2.5` and its METADATA: the
# cuda12 extra is 262 floors (`name>=X`), not exact pins. The 16 packages marked
# "missing #N" were found in that order by importing the four modules above in a venv
# holding only maxtext + jax and installing what the ModuleNotFoundError named, each with
# the extra's floors as constraints (`pip install -c floors.txt NAME`); the rest came in as
# their dependencies. Each pin below is what pip's resolver picked then (the newest release
# within the extra's floors and the packages' own bounds, 2026-12-04), frozen so that a
# rebuild is the same; "extra >=X" is the cuda12 extra's floor for that package, "needed
# by" who required it. Four are not named by the extra: duckdb (xprof), httpx2/httpcore2
# (huggingface-hub 2.x), kernels (transformers 5.x), truststore (httpx2).
# sympy stays at 1.12: the extra's floor mpmath>=1.4.1 excludes sympy 1.13+ (mpmath<1.4).
# Not installed, though the extra names them: google-cloud-* beyond storage, keras, datasets,
# pytest, pylint, ... (nothing the decoder imports); MaxText's own try/except imports
# (librosa, tensorflow) are absent from the extra too and not installed.
#
# 125 packages, 1.4 GB; 100 s on 2 cores with no pip cache (PIP_NO_CACHE_DIR=1), measured.
set -euo pipefail

PY=${1:-/opt/py313/bin/python3.13}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${2:-$ROOT/.venv313-maxtext}

"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 13), sys.version' \
  || { echo "maxtext_env.sh: $PY is not Python 3.13" >&2; exit 2; }

start=$SECONDS
"$PY" -m venv --clear "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

pins=$(mktemp)
trap 'rm -f "$pins"' EXIT
cat >"$pins" <<'PINS'
maxtext==0.2.5                   # the package (its METADATA: Requires-Python >=3.12)
jax==0.12.0.1                    # extra >=0.11.1; this project allows <0.13
jaxlib==0.12.0.1                 # extra >=0.11.1; CPU (jax-cuda12-plugin left out)
absl-py==2.5.1                   # extra >=2.5.0; needed by aqtp, array-record, drjax, einshape, grain, optax, orbax-checkpoint, pathwaysutils, qwix, tokamax, xprof
aiofiles==25.1.0                 # extra >=25.1.0; needed by orbax-checkpoint
aiohappyeyeballs==2.7.1          # extra >=2.7.1; needed by aiohttp
aiohttp==3.14.5                  # extra >=3.14.3; needed by gcsfs
aiosignal==1.4.0                 # extra >=1.4.0; needed by aiohttp
annotated-doc==0.0.7             # extra >=0.0.5; needed by fastapi, typer
annotated-types==0.8.0           # extra >=0.8.0; needed by pydantic
anyio==4.16.0                    # extra >=4.15.1; needed by fastapi, httpx2, starlette
aqtp==0.9.0                      # missing #7: maxtext/layers/quantizations.py (import aqt); extra >=0.9.0
array_record==0.8.6              # extra >=0.8.3; needed by grain
attrs==26.1.0                    # extra >=26.1.0; needed by aiohttp
certifi==2026.10.19.post1        # extra >=2026.7.22; needed by requests
cffi==2.1.1                      # extra >=2.1.1; needed by cryptography
charset-normalizer==3.5.3        # extra >=3.5.1; needed by requests
cheroot==11.1.2                  # extra >=11.1.2; needed by xprof
click==8.5.1                     # extra >=8.5.0; needed by huggingface-hub, uvicorn
cloudpickle==3.1.3               # extra >=3.1.2; needed by grain
cryptography==50.0.2             # extra >=50.0.1; needed by google-auth
decorator==5.3.1                 # extra >=5.3.1; needed by gcsfs
drjax==0.2.1                     # missing #12: maxtext/utils/diloco_sharding.py; extra >=0.2.1
duckdb==2.0.1                    # not in the extra; needed by xprof
einshape==1.0                    # extra >=1.0; needed by tokamax
etils==1.15.0                    # extra >=1.14.0; needed by array-record, array-record (etils[epath]), grain, grain (etils[epath]), orbax-checkpoint, orbax-checkpoint (etils[epath]), xprof, xprof (etils[epath])
fastapi==0.165.0                 # extra >=0.141.1; needed by pathwaysutils
filelock==4.3.2                  # extra >=3.32.3; needed by huggingface-hub
fire==0.7.1                      # extra >=0.7.1; needed by xprof
flax==0.12.12                    # missing #2: maxtext/common/common_types.py; extra >=0.12.9; needed by aqtp, qwix, zeropp-jax
frozenlist==1.8.0                # extra >=1.8.0; needed by aiohttp, aiosignal
fsspec==2026.9.0                 # extra >=2026.2.0; needed by array-record (etils[epath]), gcsfs, grain (etils[epath]), huggingface-hub, orbax-checkpoint (etils[epath]), xprof, xprof (etils[epath])
gcsfs==2026.10.1                 # extra >=2026.2.0; needed by xprof (fsspec[gcs])
google-api-core==2.44.0          # extra >=2.38.0; needed by google-cloud-core, google-cloud-storage, google-cloud-storage-control
google-auth==2.63.0              # extra >=2.58.0; needed by gcsfs, google-api-core, google-auth-oauthlib, google-cloud-core, google-cloud-storage, google-cloud-storage-control
google-auth-oauthlib==1.5.0      # extra >=1.4.1; needed by gcsfs
google-cloud-core==2.8.0         # extra >=2.7.0; needed by google-cloud-storage
google-cloud-storage==3.17.1     # extra >=3.14.1; needed by gcsfs, xprof
google-cloud-storage-control==1.17.0 # extra >=1.15.0; needed by gcsfs
google-crc32c==1.9.0             # extra >=1.8.0; needed by google-cloud-storage, google-resumable-media
google-resumable-media==2.11.0   # extra >=2.10.2; needed by google-cloud-storage
googleapis-common-protos==1.76.0 # extra >=1.75.3; needed by google-api-core, grpc-google-iam-v1, grpcio-status
grain==0.2.18                    # missing #11: maxtext/common/grain_utility.py; extra >=0.2.18
grpc-google-iam-v1==0.14.6       # extra >=0.14.5; needed by google-cloud-storage-control
grpcio==1.85.3                   # extra >=1.83.0; needed by google-cloud-storage-control, google-cloud-storage-control (google-api-core[grpc]), grpc-google-iam-v1, grpc-google-iam-v1 (googleapis-common-protos[grpc]), grpcio-status
grpcio-status==1.85.3            # extra >=1.83.0; needed by google-cloud-storage-control (google-api-core[grpc])
gviz-api==1.10.0                 # extra >=1.10.0; needed by xprof
h11==0.16.0                      # extra >=0.16.0; needed by httpcore2, uvicorn
hf-xet==1.8.0                    # extra >=1.6.0; needed by huggingface-hub
httpcore2==2.16.2                # not in the extra; needed by httpx2
httpx2==2.16.2                   # not in the extra; needed by huggingface-hub
huggingface_hub==2.4.0           # missing #9: maxtext/checkpoint_conversion/utils/load_dynamic.py; extra >=1.32.0; needed by kernels, tokenizers, transformers
humanize==4.17.0                 # extra >=4.16.0; needed by orbax-checkpoint
idna==3.20                       # extra >=3.18; needed by anyio, httpx2, requests, yarl
immutabledict==4.3.1             # extra >=4.3.1; needed by tokamax
jaraco.functools==4.6.0          # extra >=4.6.0; needed by cheroot
jaxtyping==0.3.11                # extra >=0.3.11; needed by tokamax
Jinja2==3.1.6                    # missing #5: maxtext/configs/types.py; extra >=3.1.6
kernels==0.19.1                  # not in the extra; needed by transformers
markdown-it-py==4.3.0            # extra >=4.2.0; needed by rich
MarkupSafe==3.0.4                # extra >=3.0.3; needed by jinja2, werkzeug
mdurl==0.1.2                     # extra >=0.1.2; needed by markdown-it-py
ml_dtypes==0.7.0                 # extra >=0.6.0; needed by jax, jaxlib, tensorstore, xprof
more-itertools==11.2.1           # extra >=11.1.0; needed by cheroot, jaraco-functools
mpmath==1.4.1                    # extra >=1.4.1; needed by sympy
msgpack==1.2.4                   # extra >=1.2.2; needed by flax, orbax-checkpoint
multidict==7.2.1                 # extra >=6.9.1; needed by aiohttp, yarl
numpy==2.5.5                     # extra >=2.1.3; needed by einshape, flax, grain, jax, jaxlib, ml-dtypes, optax, orbax-checkpoint, qwix, scipy, tensorboardx, tensorstore, transformers, treescope, xprof, zeropp-jax
oauthlib==4.0.1                  # extra >=3.3.1; needed by requests-oauthlib
omegaconf==2.4.0                 # missing #1: maxtext/configs/pyconfig.py; extra >=2.3.1
opentelemetry-api==1.45.2        # extra >=1.44.0; needed by fastapi, google-api-core
opt_einsum==3.4.0                # extra >=3.4.0; needed by jax, qwix
optax==0.2.8                     # extra >=0.2.8; needed by flax, zeropp-jax
orbax-checkpoint==0.12.8         # extra >=0.12.4; needed by flax, pathwaysutils, zeropp-jax
packaging==26.4                  # missing #3: maxtext/utils/max_utils.py; extra >=26.3; needed by huggingface-hub, kernels, pathwaysutils, tensorboardx, transformers
pathwaysutils==0.1.13            # missing #4: maxtext/utils/elastic_utils.py; extra >=0.1.11
pillow==13.0.0                   # missing #13: maxtext/multimodal/utils.py (import PIL); extra >=12.3.0
portpicker==1.6.0                # extra >=1.6.0; needed by grain
prometheus_client==0.26.0        # extra >=0.26.0; needed by orbax-checkpoint
propcache==0.5.4                 # extra >=0.5.4; needed by aiohttp, yarl
proto-plus==1.29.0               # extra >=1.28.4; needed by google-api-core, google-cloud-storage-control
protobuf==7.36.2                 # extra >=6.33.6; needed by google-api-core, google-cloud-storage-control, googleapis-common-protos, grain, grpc-google-iam-v1, grpcio-status, orbax-checkpoint, proto-plus, tensorboardx, xprof
psutil==7.2.2                    # extra >=7.2.2; needed by orbax-checkpoint, portpicker
pyasn1==0.6.5                    # extra >=0.6.4; needed by pyasn1-modules
pyasn1_modules==0.4.2            # extra >=0.4.2; needed by google-auth
pycparser==3.12                  # extra >=3.0; needed by cffi
pydantic==2.14.4                 # extra >=2.13.5; needed by fastapi, tokamax, typer
pydantic_core==2.50.5            # extra >=2.46.5; needed by pydantic
Pygments==2.21.0                 # extra >=2.21.0; needed by rich
PyYAML==6.0.4                    # extra >=6.0.3; needed by flax, huggingface-hub, kernels, omegaconf, orbax-checkpoint, transformers
qwix==0.1.8                      # missing #6: maxtext/layers/nnx_wrappers.py; extra >=0.1.8; needed by tokamax
regex==2026.11.19                # extra >=2026.9.10; needed by tiktoken, transformers
requests==2.34.2                 # extra >=2.34.2; needed by gcsfs, google-api-core, google-cloud-storage, pathwaysutils, requests-oauthlib, tiktoken
requests-oauthlib==2.0.0         # extra >=2.0.0; needed by google-auth-oauthlib
rich==15.0.0                     # extra >=15.0.0; needed by flax, typer
safetensors==0.8.0               # extra >=0.8.0; needed by transformers
scipy==1.18.1                    # extra >=1.18.0; needed by jax, jaxlib
sentencepiece==0.2.3             # missing #15: maxtext/input_pipeline/tokenizer.py; extra >=0.2.2
shellingham==1.5.4               # extra >=1.5.4; needed by typer
simplejson==4.3.0                # extra >=4.1.2; needed by orbax-checkpoint
six==1.17.0                      # extra >=1.17.0; needed by gviz-api, xprof
starlette==1.10.0                # extra >=1.6.0; needed by fastapi
sympy==1.12                      # missing #16: maxtext/layers/engram.py; extra >=1.12
tensorboardX==2.6.5              # extra >=2.6.5; needed by tokamax
tensorstore==0.1.86              # extra >=0.1.85; needed by flax, orbax-checkpoint
termcolor==3.3.0                 # extra >=3.3.0; needed by fire
tiktoken==0.14.0                 # missing #14: maxtext/input_pipeline/tokenizer.py; extra >=0.14.0
tokamax==0.0.17                  # missing #8: maxtext/kernels/megablox/ops.py; extra >=0.0.14
tokenizers==0.23.3               # extra >=0.23.2; needed by transformers
tomlkit==0.15.3                  # extra >=0.15.1; needed by kernels
tqdm==4.70.1                     # extra >=4.70.1; needed by huggingface-hub, tokamax, transformers, zeropp-jax
transformers==5.25.0             # missing #10: maxtext/checkpoint_conversion/utils/hf_model_configs.py; extra >=5.17.0
treescope==0.1.10                # extra >=0.1.10; needed by flax
truststore==0.10.5               # not in the extra; needed by httpcore2, httpx2
typer==0.29.2                    # extra >=0.27.2; needed by transformers
typing_extensions==4.16.0        # extra >=4.16.0; needed by anyio, array-record (etils[epath]), fastapi, flax, grain (etils[epath]), grain (etils[epy]), grpcio, huggingface-hub, opentelemetry-api, orbax-checkpoint, orbax-checkpoint (etils[epath]), orbax-checkpoint (etils[epy]), pydantic, pydantic-core, typing-inspection, xprof (etils[epath])
typing-inspection==0.4.5         # extra >=0.4.4; needed by fastapi, pydantic
urllib3==2.8.0                   # extra >=2.7.0; needed by requests, xprof
uvicorn==0.55.0                  # extra >=0.53.0; needed by pathwaysutils
uvloop==0.23.0                   # extra >=0.22.1; needed by orbax-checkpoint
wadler_lindig==0.1.8             # extra >=0.1.7; needed by jaxtyping
Werkzeug==3.1.9                  # extra >=3.1.8; needed by xprof
xprof==2.24.2                    # extra >=2.20.0; needed by tokamax
yarl==1.25.1                     # extra >=1.25.1; needed by aiohttp
zipp==4.1.2                      # extra >=4.1.0; needed by array-record (etils[epath]), grain (etils[epath]), orbax-checkpoint (etils[epath]), xprof (etils[epath])
PINS

# One resolver run over exact pins: pip fails if they are inconsistent; a package they
# missed would be added, which the freeze check below refuses.
timeout 1200 "${PIP[@]}" install --only-binary :all: -r "$pins"
# The venv holds exactly the pins (and pip), and they are consistent.
want=$(sed -E 's/[[:space:]]*#.*//; /^$/d' "$pins" | tr '[:upper:]' '[:lower:]' | tr '_.' '--' | sort)
have=$("${PIP[@]}" freeze --all | grep -v -E '^pip==' \
  | tr '[:upper:]' '[:lower:]' | tr '_.' '--' | sort)
if [ "$want" != "$have" ]; then
  echo "maxtext_env.sh: the venv differs from the pins (< pins, > venv):" >&2
  diff <(echo "$want") <(echo "$have") >&2 || true
  exit 1
fi
"${PIP[@]}" check

# This project, editable, without its dependencies: those it imports are all above (it
# allows jax < 0.13); `chex`, which it declares but does not import, is not, so pip check
# names it from here on. The build backend (setuptools) comes into pip's isolated build
# environment.
timeout 600 "${PIP[@]}" install --no-deps -e "$ROOT"

# What the probe imports, without backports; jax must be the CPU 0.12.0.1.
JAX_PLATFORMS=cpu "$VENV/bin/python" - <<'PY' 2>&1 | grep -v rope_scaling
import importlib, jax
for m in ("maxtext.configs.pyconfig", "maxtext.models.models", "maxtext.utils.maxtext_utils",
          "maxtext.utils.sharding", "zeropp_jax"):
    importlib.import_module(m)
assert jax.__version__ == "0.12.0.1" and jax.default_backend() == "cpu", jax.__version__
print(f"maxtext_env.sh: imports ok, jax {jax.__version__} ({jax.default_backend()})")
PY
echo "maxtext_env.sh: $VENV, $(du -sh "$VENV" | cut -f1), $((SECONDS - start)) s"
