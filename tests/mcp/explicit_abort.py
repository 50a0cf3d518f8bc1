"""Scenario 3: saga_begin, a flight and a hotel, then saga_abort: both are compensated (the
hotel first) and the transaction is no longer open."""

from scenario import book_trip, check, compensated_tools, main, open_session, summary


async def scenario(opts):
    async with open_session(opts) as session:
        transaction = await session.begin("abort-demo", timeout="60s")
        trip = await book_trip(session)
        status = await session.control("saga_status")
        check(status.get("transaction") == transaction and status.get("state") == "open",
              "the begun transaction is not open", status=status)
        steps = status.get("steps", [])
        check([s.get("step") for s in steps] == ["call-1", "call-2"]
              and [s.get("output") for s in steps] == [trip["flight"].structured, trip["hotel"].structured],
              "saga_status does not list the two calls with their outputs", status=status)
        check(all(s.get("compensator") for s in steps), "a booked step has no compensator", status=status)
        aborted = await session.control("saga_abort", reason="the traveller changed plans")
        check(aborted.get("status") == "aborted" and aborted.get("transaction") == transaction,
              "saga_abort did not abort the transaction", result=aborted)
        undone = compensated_tools(aborted)
        check(undone == ["hotel__reserve", "airline__book"], "unexpected compensations", result=aborted)
        # A closed transaction reports a state other than open, or that it is closed.
        after = await session.call("saga_status", {"transaction": transaction}, expect_error=None)
        code = ((after.structured or {}).get("error") or {}).get("code")
        state = code if after.is_error else (after.structured or {}).get("state")
        check(state not in ("open", None) and (code in (None, "transaction_closed")),
              "the aborted transaction is still open", status=after.structured, text=after.text)
    return {"transaction": transaction, "booked": summary(trip), "compensated": undone, "state": state}


if __name__ == "__main__":
    main(scenario)
