"""Scenario 2: a session books a flight and a hotel, then the charge is declined: the result
is an error naming both compensations (the hotel first), and the transaction is closed.
Prints the transaction id, the compensations and the error."""

from scenario import book_trip, check_rolled_back, decline, main, open_session, parse, summary


def arguments(parser):
    parser.add_argument("--airline", default="airline", help="the plugin that books the flight")


async def scenario(opts):
    airline = opts.extra.airline
    async with open_session(opts) as session:
        if session.explicit:
            await session.begin("trip")
        trip = await book_trip(session, airline)
        transaction = trip["flight"].transaction
        declined = await decline(session, trip)
        undone = check_rolled_back(declined, transaction, ["hotel__reserve", f"{airline}__book"])
    return {"transaction": transaction, "booked": summary(trip), "compensated": undone,
            "error": declined.structured["error"]}


if __name__ == "__main__":
    main(scenario, parse(arguments))
