"""Scenario 8: a call retried with the same `_meta.idempotency_key` is answered from the
record (`io.sagabox/replayed: true`) and does not book again; the transaction is committed so
that the test can count the seats."""

import uuid

from scenario import TRIP, check, main, open_session


async def scenario(opts):
    key = f"retry-{uuid.uuid4().hex}"
    async with open_session(opts) as session:
        transaction = await session.begin("retry")
        first = await session.call("airline__book", TRIP["flight"], meta={"idempotency_key": key})
        retry = await session.call("airline__book", TRIP["flight"], meta={"idempotency_key": key})
        check(first.meta.get("io.sagabox/replayed") is False, "the first call says it was replayed", meta=first.meta)
        check(retry.meta.get("io.sagabox/replayed") is True, "the retry was not replayed", meta=retry.meta)
        check(retry.structured == first.structured and retry.text == first.text,
              "the retry's result differs from the first", first=first.structured, retry=retry.structured)
        check(retry.step == first.step == "call-1" and retry.transaction == first.transaction == transaction,
              "the retry is not the same step of the same transaction", first=first.meta, retry=retry.meta)
        status = await session.control("saga_status")
        check(len(status.get("steps", [])) == 1, "the retry added a step", status=status)
        committed = await session.control("saga_commit")
        check(committed.get("status") == "committed", "saga_commit did not commit", result=committed)
    return {"transaction": transaction, "flight": first.structured["confirmationNumber"], "key": key}


if __name__ == "__main__":
    main(scenario)
