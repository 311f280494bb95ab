"""A durable pydantic-ai agent: every model request and every tool call of
an agent run inside an everystep workflow is a step (extra
`everystep[pydantic-ai]`). See docs/agents.md.

Built as pydantic-ai's own durable integrations (Temporal, DBOS, Prefect)
are: `EverystepDurability` is the durability capability — its backend runs
each durable operation pydantic-ai declares (a model request, a tool call,
a toolset's discovery, an event handler's call) as one everystep step, named
by pydantic-ai's journal convention, its result stored as JSON — and
`EverystepAgent(agent, name=...)` wraps an `Agent` with it, as the DBOS and
Prefect wrappers do. Outside a workflow body (outside a run, or inside a
step) the agent runs as it is.

While a model request streams (always, under the wrapper), the text it
produces is written to the run's durable stream `stream_key` from inside
the request's step: a caller reads it with `everystep.read_stream` or over
Server-Sent Events as it comes. A request that is retried, or runs again
after a crash, writes its text again; the entries carry its try (see
docs/streams.md for how a reader keeps the last try's only).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Collection, Mapping
from contextvars import ContextVar
from typing import Any, Literal

from pydantic_ai import messages as _messages
from pydantic_ai.agent import AbstractAgent, WrapperAgent
from pydantic_ai.durable_exec._base import BaseDurabilityCapability
from pydantic_ai.durable_exec._codec import JSON_CODEC
from pydantic_ai.durable_exec._operation import DurableOperationId, ToolsetCallToolId, ToolsetValidateToolArgumentsId
from pydantic_ai.durable_exec._operation_backend import (
    CallableOperationBackend,
    JournalCallableOperationBackend,
    RoleBasedOperationConfig,
)
from pydantic_ai.durable_exec._spec import DurabilityEngineSpec
from pydantic_ai.models import Model
from pydantic_ai.tools import AgentDepsT, RunContext

from everystep import streams
from everystep.context import Scope, current_scope
from everystep.errors import EverystepError

# A step's options, per operation: {"unsafe_to_repeat": bool}.
StepOptions = dict[str, Any]


# The workflow body's scope an agent run records its steps in. The agent's
# own machinery runs outside it (current_scope unset), so that the tasks it
# starts and the asyncio.wait it does are not taken for the body's.
_agent_scope: ContextVar[Scope | None] = ContextVar("everystep_agent_scope", default=None)


def in_workflow_body() -> bool:
    """Whether an agent runs in a workflow body (its calls become steps), not in a step nor outside a run."""
    return _agent_scope.get() is not None or current_scope.get() is not None


@contextlib.asynccontextmanager
async def agent_scope() -> AsyncIterator[None]:
    """Around an agent's run in a workflow body: its steps go to the body's
    scope, its own tasks are plain ones."""
    scope = current_scope.get()
    if scope is None:
        yield
        return
    agent_token, scope_token = _agent_scope.set(scope), current_scope.set(None)
    try:
        yield
    finally:
        current_scope.reset(scope_token)
        _agent_scope.reset(agent_token)


class EverystepOperationBackend(JournalCallableOperationBackend[StepOptions]):
    """Runs each durable operation as one everystep step (its name: the
    operation's journal name; its result: the operation's JSON payload)."""

    async def execute(self, *, operation_id: DurableOperationId, name: str, body: Callable[[], Awaitable[object]],
                      cache_key: tuple[object, ...], config: StepOptions) -> object:
        scope = _agent_scope.get() or current_scope.get()
        if scope is None:
            return await body()

        async def unit() -> object:
            token = _agent_scope.set(None)  # inside the step: what it calls is plain
            try:
                return await body()
            finally:
                _agent_scope.reset(token)

        unsafe = bool((config or {}).get("unsafe_to_repeat"))
        replay = scope.run.replay
        if replay.asynchronous:
            return await replay.step(scope, unit, name, unsafe, (), {}, None)
        # A sync workflow (agent.run_sync): its body's loop runs on the run's
        # thread, which the step's rules block; the operation runs on a loop
        # of its own, on a thread of its own.
        return replay.step(scope, _on_a_thread(unit), name, unsafe, (), {}, None)


def _on_a_thread(body: Callable[[], Awaitable[object]]) -> Callable[[], object]:
    def run() -> object:
        context = contextvars.copy_context()  # the step's (its try, for stream entries)
        answer: dict[str, Any] = {}

        def target() -> None:
            try:
                answer["value"] = context.run(asyncio.run, body())
            except BaseException as exc:  # noqa: BLE001  (raised again on the step's thread)
                answer["error"] = exc

        thread = threading.Thread(target=target, name="everystep-agent-operation")
        thread.start()
        thread.join()
        if "error" in answer:
            raise answer["error"]
        return answer["value"]
    return run


class EverystepDurability(BaseDurabilityCapability[AgentDepsT]):
    """The durability capability that `EverystepAgent` adds to every run of
    the agent (in an async workflow the wrapper is needed: it keeps the
    agent's own tasks out of the body's scope). Inside an everystep workflow body
    every model request and tool call of the agent is a step; a tool named in
    `unsafe_tools`, or with `metadata={"everystep": {"unsafe_to_repeat": True}}`,
    is an `unsafe_to_repeat` step. `stream_key`: the run's durable stream the
    model's text is written to as it streams (None: none)."""

    engine_spec = DurabilityEngineSpec(
        engine_name="everystep",
        durable_unit_noun="step",
        durable_container_noun="workflow",
        codec=JSON_CODEC,  # steps store JSON
        wrapped_toolset_kinds=frozenset({"function", "mcp", "dynamic"}),
        toolset_lifecycles={"function": "enter-always", "mcp": "enter-in-durable-unit", "dynamic": "enter-never"},
        journal_discovery=True,
        # Step ids are positional: tool calls run one after the other, so a
        # replay gives each the same id.
        sequential_tools_in_durable_context=True,
        unsupported_runtime_toolset_kinds=frozenset({"function", "mcp", "dynamic"}),
        tool_config_key="everystep",
    )

    def __init__(self, *, name: str | None = None, models: Mapping[str, Model] | None = None,
                 unsafe_tools: Collection[str] = (), stream_key: str | None = None):
        if stream_key is not None:
            streams._key("EverystepDurability()", stream_key)
        self.stream_key = stream_key
        self.unsafe_tools = frozenset(unsafe_tools)
        super().__init__(models=models, name=name,
                         event_stream_handler=self._stream_text if stream_key is not None else None)

    @property
    def in_durable_context(self) -> bool:
        return in_workflow_body()

    def get_durable_operation_backend(self) -> CallableOperationBackend[StepOptions]:
        resolve = self._build_resolve_tool_config({})

        def tool_config(operation_id: DurableOperationId, tool: object | None, tool_name: str
                        ) -> StepOptions | Literal[False]:
            assert isinstance(operation_id, ToolsetCallToolId | ToolsetValidateToolArgumentsId)
            config = resolve(tool, tool_name)  # the tool's metadata, if any
            if config is False:
                return False
            if tool_name in self.unsafe_tools:
                return {**(config or {}), "unsafe_to_repeat": True}
            return config or {}

        return EverystepOperationBackend(
            agent_name=self.name, default_model_id=self.default_model_id,
            config=RoleBasedOperationConfig(model={}, event={}, capability={}, tool={}, resolve_tool=tool_config))

    async def _stream_text(self, ctx: RunContext[AgentDepsT], events: AsyncIterable[_messages.AgentStreamEvent]
                           ) -> None:
        """The model's text as it streams, into the run's durable stream
        (inside the request's step: at least once, tagged with its try)."""
        async for event in events:
            text = None
            if isinstance(event, _messages.PartStartEvent) and isinstance(event.part, _messages.TextPart):
                text = event.part.content
            elif isinstance(event, _messages.PartDeltaEvent) and isinstance(event.delta, _messages.TextPartDelta):
                text = event.delta.content_delta
            if text and streams.current_run.get() is not None:
                await streams.awrite_stream(self.stream_key, text)


class EverystepAgent(WrapperAgent[AgentDepsT, Any]):
    """`agent`, durable inside everystep workflows: every model request and
    tool call is a step (see EverystepDurability for `unsafe_tools` and
    `stream_key`). `name` (else the agent's) names its steps: keep it stable
    while runs are in flight. Outside a workflow body it runs as `agent`."""

    def __init__(self, wrapped: AbstractAgent[AgentDepsT, Any], *, name: str | None = None,
                 unsafe_tools: Collection[str] = (), stream_key: str | None = "output",
                 models: Mapping[str, Model] | None = None):
        super().__init__(wrapped)
        self._name = name or wrapped.name
        if not self._name:
            raise EverystepError("EverystepAgent needs a name (name=... or the agent's): it names the agent's steps")
        self.durability = EverystepDurability(name=self._name, models=models, unsafe_tools=unsafe_tools,
                                              stream_key=stream_key)

    @property
    def name(self) -> str | None:
        return self._name

    @name.setter
    def name(self, value: str | None) -> None:
        raise EverystepError("an EverystepAgent's name names its recorded steps: set it when wrapping")

    @contextlib.asynccontextmanager
    async def iter(self, *args: Any, capabilities: Any = None, **kwargs: Any) -> AsyncIterator[Any]:
        """The wrapped agent's `iter`, with the durability capability added
        (`run`, `run_sync`, `run_stream` and `run_stream_events` go through it)."""
        async with agent_scope(), self.wrapped.iter(
                *args, capabilities=[*(capabilities or ()), self.durability], **kwargs) as run:
            yield run
