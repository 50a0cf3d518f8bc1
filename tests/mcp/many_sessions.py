"""Scenario 7: many concurrent sessions on one HTTP server. Session i speaks the legacy
protocol (its transaction is its Mcp-Session-Id's) when i is even, the modern one (explicit
handles) when odd; it books a flight and a hotel, then commits (i % 3 == 0), aborts (1), or
has its charge declined (2). Each rollback must undo exactly its own two bookings. Prints
every session's transaction, outcome and bookings for the test to check the store."""

import anyio

from scenario import MODERN, book_trip, check, check_rolled_back, compensated_tools, connect, decline, main
from scenario import first_failure, parse, summary

OUTCOMES = ("commit", "abort", "decline")


def arguments(parser):
    parser.add_argument("--sessions", type=int, default=32)


async def one(url: str, i: int) -> dict:
    mode, outcome = ("legacy", MODERN)[i % 2], OUTCOMES[i % 3]
    async with connect(url, mode) as session:
        transaction = await session.begin(f"session-{i}")
        trip = await book_trip(session)
        if outcome == "commit":
            result = await session.control("saga_commit")
            check(result.get("status") == "committed", f"session {i}: not committed", result=result)
        elif outcome == "abort":
            result = await session.control("saga_abort", reason=f"session {i} aborts")
            check(result.get("status") == "aborted", f"session {i}: not aborted", result=result)
            check(compensated_tools(result) == ["hotel__reserve", "airline__book"],
                  f"session {i}: unexpected compensations", result=result)
            check([c.get("step") for c in result["compensated"]] == ["call-2", "call-1"],
                  f"session {i}: compensated other steps", result=result)
        else:
            check_rolled_back(await decline(session, trip), transaction, ["hotel__reserve", "airline__book"])
    return {"session": i, "mode": mode, "outcome": outcome, "transaction": transaction, "booked": summary(trip)}


async def scenario(opts):
    check(opts.url, "many_sessions needs --url")
    results, errors = {}, {}

    async def run(i: int) -> None:
        try:
            results[i] = await one(opts.url, i)
        except Exception as error:  # every session's failure is reported, not just the first
            errors[i] = str(first_failure(error) or repr(error))

    async with anyio.create_task_group() as group:
        for i in range(opts.extra.sessions):
            group.start_soon(run, i)
    check(not errors, f"{len(errors)} session(s) failed", errors=errors)
    transactions = [r["transaction"] for r in results.values()]
    check(len(set(transactions)) == len(transactions), "two sessions shared a transaction", transactions=transactions)
    return {"sessions": [results[i] for i in sorted(results)]}


if __name__ == "__main__":
    main(scenario, parse(arguments))
