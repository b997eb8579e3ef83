# The image behind the worker and reconciler services of docker-compose.yml.
FROM python:3.11-slim

WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir . \
    && useradd --create-home --uid 10001 orchestrator
# So that `--app demo_app:app` (or your own module) is importable from the working directory.
ENV PYTHONPATH=/app
USER orchestrator

CMD ["orchestrator", "--help"]
