"""A submitting process for the tracing acceptance test: ``python -m
tests.acceptance.trace_submit`` submits one ``two_steps`` run inside a ``request`` span of its
own and prints the run's id. Its spans go to ``$ACCEPTANCE_SPAN_FILE``."""

from __future__ import annotations

from tests.acceptance import flows


def main() -> None:
    assert flows.tracer_provider is not None, "set ACCEPTANCE_SPAN_FILE"
    with flows.tracer_provider.get_tracer("the host").start_as_current_span("request"):
        run = flows.app.submit(flows.two_steps, {})
    print(run.id, flush=True)
    flows.app.close()
    flows.tracer_provider.shutdown()


if __name__ == "__main__":
    main()
