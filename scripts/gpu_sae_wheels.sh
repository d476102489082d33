#!/usr/bin/env bash
# Here (with the package registry): fill .whl-gpu/sae/ with what SAELens (and the Parquet harvest's pyarrow) need
# on the lent GPU machine, whose image (Python 3.12, no network) has neither. Three groups, each under one call's
# 64 MiB: pyarrow alone (55 MB), the large binaries, and the rest. The pins are this project's CPU environment's
# (sae-lens and what it requires, less what vLLM's carried wheels and the image already hold); the install on the
# device (`scripts/gpu_install_missing.py`) skips any distribution the image already has. Run from the project
# root; tests/GPU.md lists the calls.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
dest=.whl-gpu/sae
mkdir -p "$dest/pyarrow" "$dest/large" "$dest/rest" .whl-gpu/download/sae
binary=(pyarrow==26.0.1 pandas==3.1.1 statsmodels==0.15.0 wandb==0.31.0 wrapt==2.5.2 xxhash==4.1.0
        multiprocess==0.70.19)
pure=(sae-lens==6.54.12 transformer-lens==3.9.0 accelerate==1.16.0 babe==0.0.7 beartype==0.23.1 better-abc==0.0.3
      config2py==0.1.76 cwevals==0.0.1b1 datasets==5.2.0 docstring-parser==0.18.0 dol==0.3.100 fancy-einsum==0.0.3
      formulaic==1.2.2 graze==0.1.46 i2==0.1.91 importlib-resources==7.1.0 interface-meta==2.0.1 jaxtyping==0.3.11
      joblib==1.6.0 narwhals==2.29.0 nltk==3.10.4 patsy==1.0.3 plotly==7.1.0 plotly-express==0.4.1
      py2store==0.1.24 python-dotenv==1.2.4 simple-parsing==0.1.9 tenacity==9.2.1
      transformers-stream-generator==0.0.5 typeguard==4.6.1 wadler-lindig==0.1.8 tzdata==2026.6
      python-dateutil==4.0.0 truststore==0.10.5 httpx2==2.17.0 httpcore2==2.17.0 opentelemetry-api==1.45.2
      opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2
      opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
      opentelemetry-proto==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
      googleapis-common-protos==1.76.0 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
      typer==0.29.2 shellingham==1.5.4 defusedxml==0.7.1 platformdirs==4.14.9)
platforms=(--only-binary=:all: --python-version 3.12 --implementation cp --platform any)
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download -q --no-deps "${platforms[@]}" -d .whl-gpu/download/sae "${binary[@]}"
# pure Python: built here where the registry has only a source archive (py2store), the same files on any Python 3
python3 -m pip wheel -q --no-deps -w .whl-gpu/download/sae "${pure[@]}"
for wheel in .whl-gpu/download/sae/*.whl; do
  case $(basename "$wheel") in
    pyarrow-*) mv "$wheel" "$dest/pyarrow/" ;;
    pandas-*|statsmodels-*|wandb-*) mv "$wheel" "$dest/large/" ;;
    *) mv "$wheel" "$dest/rest/" ;;
  esac
done
du -sh "$dest"/*
