# The image behind the worker and reconciler services of docker-compose.yml.
FROM python:3.11-slim

WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir . \
    && useradd --create-home --uid 10001 orchestrator
# So that `--app yourmodule:app` (a module of yours copied in with the project) is importable
# from the working directory; the compose file runs `orchestrator.demo:app`, which is installed.
ENV PYTHONPATH=/app
USER orchestrator

CMD ["orchestrator", "--help"]
