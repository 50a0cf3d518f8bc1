"""Scenario 4: a committed transaction keeps its effects. Commits a flight and a hotel, then
a new transaction books a second flight and its charge is declined: only that second flight
is compensated."""

from scenario import TRIP, book_trip, charge_args, check, check_rolled_back, main, open_session, summary


async def scenario(opts):
    async with open_session(opts) as session:
        committed = await session.begin("keep")
        trip = await book_trip(session)
        result = await session.control("saga_commit")
        check(result.get("status") == "committed" and result.get("transaction") == committed,
              "saga_commit did not commit", result=result)
        check(len(result.get("steps", [])) == 2, "the commit does not list the two steps", result=result)

        session.transaction = None
        if session.explicit:
            await session.begin("after")
        second = await session.call("airline__book", TRIP["flight"])
        check(second.transaction and second.transaction != committed,
              "the call after the commit did not open a new transaction", committed=committed, meta=second.meta)
        declined = await session.call("payment__charge", charge_args(1000), expect_error=True)
        check_rolled_back(declined, second.transaction, ["airline__book"])
    return {
        "committed": committed,
        "kept": summary(trip),
        "rolled_back": second.transaction,
        "undone_flight": second.structured["confirmationNumber"],
    }


if __name__ == "__main__":
    main(scenario)
