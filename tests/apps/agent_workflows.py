"""Workflows that run a durable pydantic-ai agent (tests/test_agents.py).
The model is a FunctionModel (no network): it asks for three tool calls,
one per request, then answers; the model and every tool count their calls
in a table, and a kill file stops the worker process dead where a test
wants it."""

from __future__ import annotations

import os

import psycopg
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

import everystep
from everystep.contrib.pydantic_ai import EverystepAgent

ANSWER = "The parcel left Lyon, crossed Dijon and reached Paris: delivered."


def count(what: str) -> None:
    """One more call of `what`, in the test's table (committed at once: it
    survives the worker's death)."""
    with psycopg.connect(os.environ["EVERYSTEP_AGENT_TEST_URL"], autocommit=True) as conn:
        conn.execute("INSERT INTO agent_calls (what) VALUES (%s)", (what,))


def kill_point(what: str) -> None:
    """SIGKILL this process when the test's kill file names `what` (once: the file goes)."""
    path = os.environ.get("EVERYSTEP_AGENT_KILL_FILE")
    if path and os.path.exists(path) and open(path).read().strip() == what:
        os.remove(path)
        os.kill(os.getpid(), 9)


def _requests_so_far(messages: list[ModelMessage]) -> int:
    return sum(1 for m in messages if isinstance(m, ModelResponse))


def model_function(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    done = _requests_so_far(messages)
    kill_point(f"model {done + 1}")
    count(f"model {done + 1}")
    if done < 3:
        city = ["Lyon", "Dijon", "Paris"][done]
        return ModelResponse(parts=[ToolCallPart(f"visit_{city.lower()}", {"city": city})])
    return ModelResponse(parts=[TextPart(ANSWER)])


async def stream_function(messages: list[ModelMessage], info: AgentInfo):
    done = _requests_so_far(messages)
    kill_point(f"model {done + 1}")
    count(f"model {done + 1}")
    if done < 3:
        city = ["Lyon", "Dijon", "Paris"][done]
        from pydantic_ai.models.function import DeltaToolCall  # noqa: PLC0415
        yield {0: DeltaToolCall(name=f"visit_{city.lower()}", json_args=f'{{"city": "{city}"}}')}
        return
    for word in ANSWER.split(" "):
        yield word + " " if not ANSWER.endswith(word) else word


agent = Agent(FunctionModel(model_function, stream_function=stream_function), name="courier")


def _tool(city: str):
    def visit(city: str) -> str:
        count(f"tool {city}")
        return f"seen {city}"
    visit.__name__ = f"visit_{city.lower()}"
    return visit


for _city in ("Lyon", "Dijon", "Paris"):
    agent.tool_plain(_tool(_city))

durable = EverystepAgent(agent, name="courier", stream_key="answer")
# The same agent with the last tool's effect unsafe to repeat.
careful = EverystepAgent(agent, name="careful-courier", unsafe_tools={"visit_paris"}, stream_key=None)


@everystep.workflow
async def deliver(prompt: str) -> str:
    result = await durable.run(prompt)
    return result.output


@everystep.workflow
def deliver_sync(prompt: str) -> str:
    return durable.run_sync(prompt).output


@everystep.workflow
async def deliver_carefully(prompt: str) -> str:
    return (await careful.run(prompt)).output


@everystep.workflow
async def deliver_streamed(prompt: str) -> str:
    """run_stream in a workflow body: the text streams into the run's stream as well."""
    async with durable.run_stream(prompt) as result:
        return await result.get_output()
