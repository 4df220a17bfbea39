# syntax=docker/dockerfile:1
# The kvtune image: the agent (`kvtune`), the bundled engine (`kvengine serve`) and the
# Locust users (kvtune/locustfile.py imports kvtune, so Locust runs from this image too).
# CPU only: torch comes from PyTorch's CPU index first, so nothing later pulls a CUDA build.
#
#   docker build -t kvtune:0.1.0 .        (docker compose build does the same)

FROM python:3.11.15-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OMP_NUM_THREADS=1

# 0. g++: kvengine builds its CPU decode-attention kernel on first use (-march=native, so on
#    the host that runs it); without a compiler it falls back to the slower torch path.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# 1. torch, CPU build, before the project: the project's `torch==2.13.0` is then already met
#    (2.13.0+cpu satisfies ==2.13.0) and pip does not fetch the multi-GB CUDA wheel from PyPI.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

# 2. The project. Locust is pinned so that masters and workers on different hosts, all built
#    from this file, speak the same protocol.
WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kvtune ./kvtune
RUN pip install /app locust==2.47.0 \
    && python -c "import torch; assert not torch.cuda.is_available() and torch.__version__.startswith('2.13.0'), torch.__version__" \
    && kvtune --help >/dev/null && kvengine presets >/dev/null

# 3. An unprivileged user; /data is the working folder (reports, sqlite files, Locust samples).
# Named volumes mounted on /data/samples and /data/reports start with this ownership.
RUN useradd --create-home --uid 10001 kvtune \
    && mkdir -p /data/samples /data/reports && chown -R kvtune /data
USER kvtune
WORKDIR /data

# kvengine serve, the Streamlit UI, the Locust master (workers connect here).
EXPOSE 8000 8501 5557

CMD ["kvtune", "--help"]
