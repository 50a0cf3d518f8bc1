"""What the MCP scenarios of tests/serve.rs share: connecting to `sagabox serve` with the
official MCP Python SDK (stdio or Streamable HTTP, legacy or modern protocol), calling its
tools, checking what comes back, and reporting.

Every scenario script is run as

    python SCRIPT.py [options] --url http://127.0.0.1:PORT/mcp       # Streamable HTTP
    python SCRIPT.py [options] -- /path/to/sagabox serve [args...]   # stdio: the SDK spawns the server

and prints one JSON summary on stdout. On any failed check it prints `FAILED: ...` on stderr
and exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from mcp import Client, StdioServerParameters

MODERN = "2026-07-28"
SAGAS = Path(__file__).resolve().parents[2] / "sagas"
# The CT1 trip: a flight, a hotel night, and a gift card that cannot pay for them.
TRIP = json.loads((SAGAS / "ct1-payment-failure.input.json").read_text())
CONTROL_TOOLS = ("saga_begin", "saga_commit", "saga_abort", "saga_status")


class Failed(Exception):
    """A check of a scenario did not hold."""


def check(condition: object, message: str, **context: Any) -> None:
    if not condition:
        detail = "".join(f"\n  {k}: {json.dumps(v, default=str)}" for k, v in context.items())
        raise Failed(message + detail)


@dataclass
class Options:
    url: str | None
    mode: str
    server: list[str]
    extra: argparse.Namespace


def parse(add_arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> Options:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", help="Streamable HTTP endpoint; without it, the command after -- is run over stdio")
    parser.add_argument("--mode", default="auto", choices=["auto", "legacy", MODERN])
    if add_arguments:
        add_arguments(parser)
    args, server = parser.parse_known_args()
    if server[:1] == ["--"]:
        server = server[1:]
    if bool(args.url) == bool(server):
        parser.error("give either --url or a server command after --")
    return Options(url=args.url, mode=args.mode, server=server, extra=args)


@dataclass
class Result:
    is_error: bool
    structured: Any
    meta: dict[str, Any]
    text: str

    @property
    def transaction(self) -> str | None:
        return self.meta.get("io.sagabox/transaction")

    @property
    def step(self) -> str | None:
        return self.meta.get("io.sagabox/step")


class Session:
    """One MCP connection. `explicit` sessions (modern, stateless HTTP) have no connection
    transaction: they open one with saga_begin and name it in every call; the others (stdio,
    legacy HTTP) let the server route calls to the connection's current transaction."""

    def __init__(self, client: Client, explicit: bool) -> None:
        self.client = client
        self.explicit = explicit
        self.transaction: str | None = None

    async def call(
        self, tool: str, arguments: dict[str, Any], *, meta: dict[str, Any] | None = None,
        expect_error: bool | None = False,
    ) -> Result:
        """Calls `tool`; checks that it failed or succeeded as expected (None: either)."""
        arguments = dict(arguments)
        if self.explicit and self.transaction and tool not in CONTROL_TOOLS and "transaction" not in arguments:
            arguments["transaction"] = self.transaction
        raw = await self.client.call_tool(tool, arguments, meta=meta)
        text = "".join(getattr(block, "text", "") for block in raw.content)
        result = Result(raw.is_error, raw.structured_content, dict(raw.meta or {}), text)
        if expect_error is not None:
            check(
                result.is_error == expect_error,
                f"{tool} {'failed' if result.is_error else 'succeeded'}, expected {'a failure' if expect_error else 'success'}",
                arguments=arguments,
                structured=result.structured,
                text=result.text,
            )
        return result

    async def begin(self, name: str, timeout: str | int | None = None) -> str:
        arguments: dict[str, Any] = {"name": name}
        if timeout is not None:
            arguments["timeout"] = timeout
        begun = await self.client_tool("saga_begin", arguments)
        check(isinstance(begun.get("transaction"), str), "saga_begin returned no transaction", result=begun)
        check(begun.get("name") == name, "saga_begin did not keep the name", result=begun)
        self.transaction = begun["transaction"]
        return self.transaction

    async def control(self, tool: str, **arguments: Any) -> dict[str, Any]:
        """saga_commit / saga_abort / saga_status on this session's transaction."""
        if self.transaction and "transaction" not in arguments:
            arguments["transaction"] = self.transaction
        return await self.client_tool(tool, arguments)

    async def client_tool(self, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        result = await self.call(tool, arguments)
        check(isinstance(result.structured, dict), f"{tool} returned no structured content", text=result.text)
        return result.structured


def explicit(url: str | None, mode: str) -> bool:
    return url is not None and mode != "legacy"


@contextlib.asynccontextmanager
async def connect(url: str | None, mode: str, server: list[str] | None = None) -> AsyncIterator[Session]:
    if url:
        target: str | StdioServerParameters = url
    else:
        assert server
        passed = {k: v for k, v in os.environ.items() if k.startswith("SAGABOX_")}
        target = StdioServerParameters(command=server[0], args=server[1:], env=passed)
    async with Client(target, mode=mode, read_timeout_seconds=120) as client:
        yield Session(client, explicit(url, mode))


def open_session(opts: Options) -> contextlib.AbstractAsyncContextManager[Session]:
    return connect(opts.url, opts.mode, opts.server)


# --- the trip ---------------------------------------------------------------------------


def served(tool: str) -> str:
    """`plugin.tool` as served (`plugin__tool`); served names are left as they are."""
    return tool.replace(".", "__")


def charge_args(amount: float) -> dict[str, Any]:
    return {**TRIP["payment"], "reference": "trip", "amount": amount}


async def book_trip(session: Session, airline: str = "airline") -> dict[str, Result]:
    """Books the flight, then the hotel; both must succeed in one transaction."""
    flight = await session.call(f"{airline}__book", TRIP["flight"])
    hotel = await session.call("hotel__reserve", TRIP["hotel"])
    for name, result in (("flight", flight), ("hotel", hotel)):
        check(isinstance(result.structured, dict), f"the {name} result has no structured content", text=result.text)
        check(result.structured.get("confirmationNumber"), f"the {name} has no confirmation number", result=result.structured)
        check(result.transaction, f"the {name} result names no transaction", meta=result.meta)
        check(result.meta.get("io.sagabox/replayed") is False, f"a first {name} call says it was replayed", meta=result.meta)
    check(flight.transaction == hotel.transaction, "the flight and the hotel went to different transactions",
          flight=flight.meta, hotel=hotel.meta)
    if session.transaction:
        check(flight.transaction == session.transaction, "the calls did not go to the begun transaction",
              begun=session.transaction, meta=flight.meta)
    check([flight.step, hotel.step] == ["call-1", "call-2"], "unexpected step names", flight=flight.meta, hotel=hotel.meta)
    return {"flight": flight, "hotel": hotel}


async def decline(session: Session, trip: dict[str, Result]) -> Result:
    """Charges the gift card for the hotel: the payment is declined."""
    return await session.call("payment__charge", charge_args(trip["hotel"].structured["total_price"]), expect_error=True)


def compensated_tools(report: dict[str, Any]) -> list[str]:
    check(report.get("compensation_failures") == [], "compensations failed", report=report)
    return [served(entry["tool"]) for entry in report.get("compensated", [])]


def check_rolled_back(failure: Result, transaction: str, undone: list[str]) -> list[str]:
    """`failure` is the isError result that rolled `transaction` back, undoing `undone` in that order."""
    report = failure.structured
    check(isinstance(report, dict), "the failure has no structured content", text=failure.text)
    check(report.get("status") == "rolled_back", "the failed call did not roll back", report=report)
    check(report.get("transaction") == transaction, "the failure names another transaction", expected=transaction, report=report)
    error = report.get("error") or {}
    check(error.get("kind") == "rejected" and error.get("message"), "the error is not a rejection with a message", report=report)
    tools = compensated_tools(report)
    check(tools == undone, "unexpected compensations", expected=undone, got=tools)
    return tools


def summary(trip: dict[str, Result]) -> dict[str, str]:
    return {name: result.structured["confirmationNumber"] for name, result in trip.items()}


def first_failure(error: BaseException) -> Failed | None:
    """The failed check in `error`, which task groups may have wrapped in exception groups."""
    if isinstance(error, Failed):
        return error
    for inner in getattr(error, "exceptions", ()):
        if found := first_failure(inner):
            return found
    return None


def main(scenario: Callable[[Options], Awaitable[dict[str, Any]]], opts: Options | None = None) -> None:
    opts = opts or parse()
    try:
        report = anyio.run(scenario, opts)
    except Exception as error:
        failed = first_failure(error)
        if failed is None:
            raise
        print(f"FAILED: {failed}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(report, indent=1, sort_keys=True))
