"""Scenarios 5 and 6: a session books a flight and a hotel and goes away with its transaction
open. Over stdio the connection then ends; over legacy HTTP the client deletes its session;
over modern HTTP the transaction stays open (until --timeout, when given, or until the test
kills the server). Prints the transaction and what it booked, for the test to watch the store."""

from scenario import book_trip, check, main, open_session, parse, summary


def arguments(parser):
    parser.add_argument("--timeout", help="the transaction's own timeout (saga_begin's `timeout`)")


async def scenario(opts):
    async with open_session(opts) as session:
        transaction = None
        if session.explicit or opts.extra.timeout:
            transaction = await session.begin("walk-away", timeout=opts.extra.timeout)
        trip = await book_trip(session)
        transaction = trip["flight"].transaction
        status = await session.control("saga_status", transaction=transaction)
        check(status.get("state") == "open" and len(status.get("steps", [])) == 2,
              "the transaction is not open with its two steps", status=status)
    return {"transaction": transaction, "booked": summary(trip)}


if __name__ == "__main__":
    main(scenario, parse(arguments))
