"""A typed application with known mistakes: ``mypy --strict`` against the installed package
must report an error on each line that ends with an E-comment, whose text is part of the
message, and nothing else (tests/typing/test_installed_types.py)."""

from __future__ import annotations

from typing import Any

from orchestrator import Orchestrator, ToolContext, WorkflowContext

app = Orchestrator()


@app.tool()
async def charge(ctx: ToolContext, *, customer: str, cents: int) -> dict[str, Any]:
    return {"customer": customer, "cents": cents}


@app.workflow()
async def double(ctx: WorkflowContext, n: int) -> int:
    return 2 * n


@app.workflow()
async def checkout(ctx: WorkflowContext, order: dict[str, Any]) -> str:
    await ctx.call(charge, customer="c1", cents="500")  # E: Argument "cents" to "call" of "WorkflowContext" has incompatible type "str"; expected "int"
    await ctx.call(charge, customer="c1", cents=5, bogus=1)  # E: Unexpected keyword argument "bogus" for "call" of "WorkflowContext"
    await ctx.call(charge, customer="c1")  # E: Missing named argument "cents" for "call" of "WorkflowContext"
    receipt = await ctx.call(charge, customer="c1", cents=5)
    total: int = receipt  # E: Incompatible types in assignment (expression has type "dict[str, Any]", variable has type "int")
    doubled = await ctx.run_child(double, 21)
    await ctx.publish({"step": 1})  # E: "publish" of "WorkflowContext" does not return a value
    print(total)
    return doubled  # E: Incompatible return value type (got "int", expected "str")


def submit() -> None:
    run = app.submit(double, 21)
    name: str = run.result()  # E: Incompatible types in assignment (expression has type "int", variable has type "str")
    app.submit(double, "21")  # E: Cannot infer value of type parameter "I" of "submit" of "Orchestrator"
    app.list_runs(state="waiting")  # E: Unexpected keyword argument "state" for "list_runs" of "Orchestrator"
    app.send_event(run.id, "go", eventkey="k")  # E: Unexpected keyword argument "eventkey" for "send_event" of "Orchestrator"
    app.create_worker(concurrency="4")  # E: Argument "concurrency" to "create_worker" of "Orchestrator" has incompatible type "str"; expected "int"
    for handle in app.wait([run]):
        label: str = handle.result()  # E: Incompatible types in assignment (expression has type "int", variable has type "str")
        print(name, label)
