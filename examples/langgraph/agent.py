"""A LangGraph agent that books a trip with the tools of `sagabox serve`.

The agent books a flight, reserves a hotel, then pays with a gift card that cannot cover the
trip. The payment is declined, and sagabox cancels the hotel and the flight in that order
before it answers. The agent only reports what happened. It needs no undo logic of its own.

The model is a scripted stand-in for an LLM (no network, no API key): it asks for one tool
call per turn from a fixed plan, and when a tool fails it answers with sagabox's report.
Any LangChain chat model that supports tool calling can take its place.

    python examples/langgraph/agent.py -- sagabox serve --state sagas/ct1-payment-failure.fixture.json
    python examples/langgraph/agent.py --url http://127.0.0.1:8787/mcp
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path
from typing import Any

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_mcp_adapters.client import MultiServerMCPClient
from langchain_mcp_adapters.tools import load_mcp_tools
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

FIXTURE = Path(__file__).resolve().parents[2] / "sagas" / "ct1-payment-failure.fixture.json"
USER = "mia_li_3668"
REQUEST = "Book me a flight to New York on May 16 and a hotel for the night, and pay with my gift card."

# The turns the scripted model plays: (tool, arguments).
PLAN: list[tuple[str, dict[str, Any]]] = [
    (
        "airline__book",
        {"flight_number": "HAT001", "date": "2024-05-16", "cabin": "economy", "passengers": 1, "user_id": USER},
    ),
    ("hotel__reserve", {"hotel_id": "NYC-GRAND", "check_in": "2024-05-16", "nights": 1}),
    ("payment__charge", {"user_id": USER, "payment_method_id": "gift_card_7366101", "reference": "trip", "amount": 289}),
]


def text_of(message: BaseMessage) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    return "".join(block.get("text", "") if isinstance(block, dict) else str(block) for block in content)


def report_failure(failure: ToolMessage) -> str:
    """The final answer after a failed call. sagabox's error text says why the call failed,
    and what it compensated."""
    return f"The trip is not booked: {failure.name} failed, and sagabox undid what came before it.\n{text_of(failure)}"


class ScriptedModel(BaseChatModel):
    """Plays PLAN: one tool call per turn; after a failed call, or the last call, it answers."""

    plan: list[tuple[str, dict[str, Any]]] = PLAN

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedModel:
        return self  # the plan names the tools itself

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kwargs: Any) -> ChatResult:
        results = [m for m in messages if isinstance(m, ToolMessage)]
        if results and results[-1].status == "error":
            reply = AIMessage(content=report_failure(results[-1]))
        elif len(results) < len(self.plan):
            tool, arguments = self.plan[len(results)]
            reply = AIMessage(content="", tool_calls=[{"name": tool, "args": arguments, "id": f"call-{len(results) + 1}"}])
        else:
            reply = AIMessage(content="Your trip is booked and paid for.")
        return ChatResult(generations=[ChatGeneration(message=reply)])


def build_agent(model: BaseChatModel, tools: list) -> Any:
    """The classic tool-calling loop: the model asks for a tool, the tool runs, repeat."""
    bound = model.bind_tools(tools)

    async def think(state: MessagesState) -> dict:
        return {"messages": [await bound.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", think)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()


def connection(args: argparse.Namespace) -> dict[str, Any]:
    if args.url:
        return {"transport": "streamable_http", "url": args.url}
    command = args.server or ["sagabox", "serve", "--state", str(FIXTURE)]
    env = {k: v for k, v in os.environ.items() if k.startswith("SAGABOX_")}
    return {"transport": "stdio", "command": command[0], "args": command[1:], "env": env}


async def main(args: argparse.Namespace) -> None:
    client = MultiServerMCPClient({"sagabox": connection(args)})
    # One session for the whole conversation: sagabox keeps the trip's transaction per
    # connection, so every call of the agent must go through the same one.
    async with client.session("sagabox") as session:
        tools = await load_mcp_tools(session)
        agent = build_agent(ScriptedModel(), tools)
        final = await agent.ainvoke({"messages": [HumanMessage(REQUEST)]})
    messages = final["messages"]
    calls = [
        {"tool": m.name, "status": m.status, "result": text_of(m)} for m in messages if isinstance(m, ToolMessage)
    ]
    answer = text_of(messages[-1])
    if args.json:
        print(json.dumps({"tool_calls": calls, "answer": answer}, indent=1))
        return
    print(f"User: {REQUEST}")
    for call in calls:
        print(f"  {call['tool']}: {call['status']}: {call['result']}")
    print(f"Agent: {answer}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="the server's Streamable HTTP endpoint; by default the command after -- runs over stdio")
    parser.add_argument("--json", action="store_true", help="print the tool calls and the answer as JSON")
    parsed, server = parser.parse_known_args()
    parsed.server = server[1:] if server[:1] == ["--"] else server
    asyncio.run(main(parsed))
