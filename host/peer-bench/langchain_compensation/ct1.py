"""CT1 (book a flight, reserve a hotel, pay with a gift card that is declined, so the hotel and
the flight are cancelled) on langchain-compensation 0.5.8, the saga library LangChain agents
use today: its `CompensationMiddleware` wraps every tool call, logs the completed bookings and,
when the payment fails, runs their compensating tools in reverse order.

The tools are real LangChain `@tool`s with the semantics of sagabox's bundled airline, hotel
and payment tools, on Python dicts standing in for the state store (loaded from the same
fixture). The tool calls take the path an agent's take, in one of two modes:

  middleware  each call as a LangChain `ToolCallRequest` through
              `CompensationMiddleware.wrap_tool_call`, whose innermost handler invokes the
              `@tool` as LangGraph's ToolNode does: the library's machinery (log, dependency
              inference, error detection, rollback plan, compensation calls) and the tools,
              with no model and no graph. The most favourable rate for the peer: the headline.
  agent       `create_comp_agent` with a scripted chat model that emits CT1's tool calls (no
              LLM): the whole agent loop the library's users run, graph steps included.

Every saga must end with the payment declined and both bookings undone: the middleware's log
must show two compensated records, and after all sagas the store must equal the fixture.
Anything else exits non-zero. Prints one JSON line.

    python ct1.py [--sagas N] [--mode middleware|agent] [--batch-abort] [--threads T] [--sagas-dir DIR]
"""

import argparse
import copy
import functools
import itertools
import json
import logging
import os
import sys
import threading
import time

from langchain_compensation import CompensationLog, CompensationMiddleware, CompensationSchema, create_comp_agent
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import ToolException, tool
from langchain.tools.tool_node import ToolCallRequest

CABINS = ("basic_economy", "economy", "business")
STORE: dict = {}  # namespace -> key -> document, as sagabox's store holds them
_ids = itertools.count(1)
_ids_lock = threading.Lock()


STORE_LOCK = threading.Lock()


def atomic(function):
    """One tool call at a time on the store, as sagabox commits each call atomically."""

    @functools.wraps(function)
    def locked(*args, **kwargs):
        with STORE_LOCK:
            return function(*args, **kwargs)

    return locked


def record_id(prefix: str) -> str:
    with _ids_lock:
        return f"{prefix}{next(_ids):024X}"


def cents(amount) -> int:
    return int(round(amount * 100))


def from_cents(c: int):
    return c // 100 if c % 100 == 0 else c / 100


def link_user(user_id, reservation_id, add):
    user = STORE.get("users", {}).get(user_id)
    if user is None or not isinstance(user.get("reservations"), list):
        return
    present = reservation_id in user["reservations"]
    if add and not present:
        user["reservations"].append(reservation_id)
    elif not add and present:
        user["reservations"].remove(reservation_id)


@tool
@atomic
def book_flight(flight_number: str, date: str, cabin: str = "economy", passengers: int = 1, user_id: str = "") -> dict:
    """Books seats on a flight; returns the confirmation number and arrival time."""
    if cabin not in CABINS:
        raise ToolException(f"unknown cabin '{cabin}'")
    flight = STORE["flights"].get(flight_number)
    if flight is None:
        raise ToolException(f"no flight '{flight_number}'")
    day = flight["dates"].get(date)
    if day is None:
        raise ToolException(f"flight {flight_number} does not fly on {date}")
    if day["status"] != "available":
        raise ToolException(f"flight {flight_number} on {date} is {day['status']}, not open for booking")
    seats = day["available_seats"].get(cabin, 0)
    if seats < passengers:
        raise ToolException(f"flight {flight_number} on {date} has {seats} {cabin} seats left, {passengers} asked")
    price = cents(day["prices"][cabin])
    day["available_seats"][cabin] = seats - passengers
    rid = record_id("R")
    reservation = {
        "reservation_id": rid,
        "user_id": user_id or None,
        "origin": flight["origin"],
        "destination": flight["destination"],
        "flight_type": "one_way",
        "cabin": cabin,
        "flights": [{"flight_number": flight_number, "date": date, "price": from_cents(price)}],
        "passengers": passengers,
        "total_price": from_cents(price * passengers),
        "arrival_time": f"{date}T{flight['scheduled_arrival_time_est']}",
        "status": "confirmed",
    }
    STORE.setdefault("reservations", {})[rid] = reservation
    if user_id:
        link_user(user_id, rid, True)
    return {
        "confirmationNumber": rid,
        "arrivalTime": reservation["arrival_time"],
        "cabin": cabin,
        "passengers": passengers,
        "total_price": reservation["total_price"],
    }


@tool
@atomic
def cancel_flight(confirmationNumber: str) -> dict:
    """Cancels a reservation and gives its seats back."""
    reservation = STORE.get("reservations", {}).pop(confirmationNumber, None)
    if reservation is None:
        return {"undone": False, "id": confirmationNumber, "reason": "nothing to undo"}
    for segment in reservation["flights"]:
        flight = STORE["flights"].get(segment["flight_number"])
        day = flight and flight["dates"].get(segment["date"])
        if day:
            seats = day["available_seats"]
            seats[reservation["cabin"]] = seats.get(reservation["cabin"], 0) + reservation["passengers"]
    if reservation["user_id"]:
        link_user(reservation["user_id"], confirmationNumber, False)
    return {"undone": True, "id": confirmationNumber}


@tool
@atomic
def reserve_hotel(hotel_id: str, check_in: str, nights: int = 1, rooms: int = 1, guest: str = "") -> dict:
    """Reserves rooms for consecutive nights; returns the confirmation number and the hotel's address."""
    hotel = STORE["hotels"].get(hotel_id)
    if hotel is None:
        raise ToolException(f"no hotel '{hotel_id}'")
    # CT1 books single nights; sagabox's tool walks the calendar for longer stays.
    if nights != 1:
        raise ToolException("this peer books one night")
    day = hotel["dates"].get(check_in)
    if day is None:
        raise ToolException(f"hotel {hotel_id} takes no bookings for {check_in}")
    if day["rooms_available"] < rooms:
        raise ToolException(f"hotel {hotel_id} has {day['rooms_available']} rooms free on {check_in}, {rooms} asked")
    day["rooms_available"] -= rooms
    bid = record_id("H")
    booking = {
        "booking_id": bid,
        "hotel_id": hotel_id,
        "address": hotel["address"],
        "nights": [check_in],
        "rooms": rooms,
        "guest": guest or None,
        "total_price": from_cents(cents(day["price"]) * rooms),
    }
    STORE.setdefault("hotel_bookings", {})[bid] = booking
    return {
        "confirmationNumber": bid,
        "address": booking["address"],
        "hotel_id": hotel_id,
        "nights": booking["nights"],
        "total_price": booking["total_price"],
    }


@tool
@atomic
def cancel_hotel(confirmationNumber: str) -> dict:
    """Cancels a hotel booking and frees its rooms."""
    booking = STORE.get("hotel_bookings", {}).pop(confirmationNumber, None)
    if booking is None:
        return {"undone": False, "id": confirmationNumber, "reason": "nothing to undo"}
    hotel = STORE["hotels"].get(booking["hotel_id"])
    for night in booking["nights"]:
        day = hotel and hotel["dates"].get(night)
        if day:
            day["rooms_available"] += booking["rooms"]
    return {"undone": True, "id": confirmationNumber}


def funds_field(method):
    if method.get("source") == "gift_card" and "balance" in method:
        return "balance"
    if method.get("source") in ("gift_card", "certificate"):
        return "amount"
    return "available_credit" if "available_credit" in method else None


@tool
@atomic
def charge_payment(user_id: str, payment_method_id: str, amount: float, reference: str = "") -> dict:
    """Charges a user's payment method; declined when its balance or credit is short."""
    user = STORE["users"].get(user_id)
    if user is None:
        raise ToolException(f"no user '{user_id}'")
    method = user["payment_methods"].get(payment_method_id)
    if method is None:
        raise ToolException(f"user {user_id} has no payment method '{payment_method_id}'")
    if method.get("status") == "blocked":
        raise ToolException(f"payment declined: {payment_method_id} is blocked")
    asked = cents(amount)
    field = funds_field(method)
    if field:
        funds = cents(method[field])
        if funds < asked:
            raise ToolException(
                f"payment declined: {payment_method_id} has {from_cents(funds)} left, {from_cents(asked)} asked"
            )
        method[field] = from_cents(funds - asked)
    pid = record_id("P")
    payment = {
        "payment_id": pid,
        "user_id": user_id,
        "payment_method_id": payment_method_id,
        "funds_field": field,
        "amount": from_cents(asked),
        "reference": reference or None,
        "status": "charged",
    }
    STORE.setdefault("payments", {})[pid] = payment
    STORE.setdefault("payment_ledger", {})[f"{pid}:charge"] = {"kind": "charge", **payment}
    return {"payment_id": pid, "amount": payment["amount"], "status": "charged"}


@tool
@atomic
def refund_payment(payment_id: str) -> dict:
    """Refunds a charge in full to the payment method it came from."""
    payment = STORE.get("payments", {}).pop(payment_id, None)
    if payment is None:
        return {"undone": False, "id": payment_id, "reason": "nothing to undo"}
    method = STORE["users"][payment["user_id"]]["payment_methods"].get(payment["payment_method_id"])
    if payment["funds_field"] and method is not None:
        field = payment["funds_field"]
        method[field] = from_cents(cents(method[field]) + cents(payment["amount"]))
    STORE.setdefault("payment_ledger", {})[f"{payment_id}:refund"] = {"kind": "refund", **payment}
    return {"undone": True, "id": payment_id}


TOOLS = [book_flight, cancel_flight, reserve_hotel, cancel_hotel, charge_payment, refund_payment]
COMPENSATION = {"book_flight": "cancel_flight", "reserve_hotel": "cancel_hotel", "charge_payment": "refund_payment"}
# What sagabox's compensators take: the record id from the forward step's output.
SCHEMAS = {
    "book_flight": CompensationSchema(param_mapping={"confirmationNumber": "result.confirmationNumber"}),
    "reserve_hotel": CompensationSchema(param_mapping={"confirmationNumber": "result.confirmationNumber"}),
    "charge_payment": CompensationSchema(param_mapping={"payment_id": "result.payment_id"}),
}


def ct1_call(step: int, trip: dict, last_result: str | None, saga: int) -> dict | None:
    """CT1's tool call number `step`, as a model would emit it, or None when CT1 is over."""
    if step == 0:
        name, args = "book_flight", trip["flight"]
    elif step == 1:
        name, args = "reserve_hotel", trip["hotel"]
    elif step == 2:
        # The charge is the hotel's total, read from the hotel tool's reply.
        amount = json.loads(last_result)["total_price"]
        name, args = "charge_payment", {**trip["payment"], "amount": amount, "reference": "trip"}
    else:
        return None
    return {"name": name, "args": args, "id": f"call-{saga}-{step}", "type": "tool_call"}


def check_rolled_back(log: CompensationLog, last: ToolMessage):
    """The payment was declined and both bookings were compensated, as the library reports it."""
    if last.name != "charge_payment" or last.status != "error" or "declined" not in str(last.content):
        raise SystemExit(f"CT1's payment was not declined: {last!r}")
    records = log.to_dict().values()
    undone = sorted(r["tool_name"] for r in records if r["compensated"])
    if undone != ["book_flight", "reserve_hotel"]:
        raise SystemExit(f"the middleware compensated {undone}, not the flight and the hotel: {list(records)}")


def middleware(log: CompensationLog) -> CompensationMiddleware:
    return CompensationMiddleware(
        compensation_mapping=COMPENSATION, tools=TOOLS, compensation_schemas=SCHEMAS, shared_log=log
    )


def execute(request: ToolCallRequest) -> ToolMessage:
    """The innermost handler, as ToolNode's: the `@tool` invoked with the tool call, which
    returns a ToolMessage (a ToolException propagates to the middleware, which reports it)."""
    return request.tool.invoke({**request.tool_call, "type": "tool_call"})


def run_middleware(trip: dict, sagas: int, first: int):
    """`sagas` CT1 runs, each tool call through CompensationMiddleware.wrap_tool_call."""
    # The log is shared between the steps of a saga and cleared between sagas, as an agent that
    # handles one request after another would. Without a shared log, the middleware keeps it in
    # the state it is handed, which LangGraph rebuilds for every step: an agent built without
    # one compensates nothing.
    log = CompensationLog()
    wrap = middleware(log).wrap_tool_call
    tools = {t.name: t for t in TOOLS}
    for saga in range(first, first + sagas):
        log.clear()
        state = {"messages": []}
        last = None
        for step in itertools.count():
            call = ct1_call(step, trip, last and last.content, saga)
            if call is None:
                break
            state["messages"].append(AIMessage(content="", tool_calls=[call]))
            last = wrap(ToolCallRequest(tool_call=call, tool=tools[call["name"]], state=state, runtime=None), execute)
            state["messages"].append(last)
            if step < 2 and last.status == "error":
                raise SystemExit(f"CT1 step {call['name']} failed: {last.content}")
        check_rolled_back(log, last)


class ScriptedCt1Model(BaseChatModel):
    """A chat model without an LLM: it emits CT1's next tool call, given the tool replies so far."""

    trip: dict

    @property
    def _llm_type(self) -> str:
        return "scripted-ct1"

    def bind_tools(self, tools, **kwargs):
        return self

    def _generate(self, messages, stop=None, run_manager=None, **kwargs):
        replies = [m for m in messages if isinstance(m, ToolMessage)]
        if replies and replies[-1].status == "error":
            message = AIMessage(content=f"CT1 stopped: {replies[-1].content}")
        else:
            saga = len(messages)  # only an id for the tool call
            call = ct1_call(len(replies), self.trip, replies[-1].content if replies else None, saga)
            message = AIMessage(content="", tool_calls=[call]) if call else AIMessage(content="done")
        return ChatResult(generations=[ChatGeneration(message=message)])


def run_agent(trip: dict, sagas: int, first: int, batch_abort: bool = False):
    """`sagas` CT1 runs through create_comp_agent with the scripted model."""
    # The batch-abort gate is off unless asked for. With it on (the library's default), sagas
    # that follow each other within 50 ms on one agent look like a parallel batch to it (ToolNode
    # runs each tool call on a pool thread): the next saga's charge is answered "Execution
    # aborted" without running and without rolling back that saga's flight and hotel, so seats
    # and rooms leak. check_rolled_back catches exactly that.
    log = CompensationLog()
    agent = create_comp_agent(
        ScriptedCt1Model(trip=trip),
        tools=TOOLS,
        compensation_mapping=COMPENSATION,
        compensation_schemas=SCHEMAS,
        shared_log=log,
        enable_batch_abort=batch_abort,
    )
    for _ in range(first, first + sagas):
        log.clear()
        out = agent.invoke({"messages": [HumanMessage(content="Book the trip and pay with my gift card.")]})
        tool_replies = [m for m in out["messages"] if isinstance(m, ToolMessage)]
        if len(tool_replies) != 3:
            raise SystemExit(f"the agent made {len(tool_replies)} tool calls, not 3: {out['messages']}")
        check_rolled_back(log, tool_replies[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sagas", type=int, default=2000)
    parser.add_argument("--mode", choices=["middleware", "agent"], default="middleware")
    parser.add_argument("--threads", type=int, default=1, help="sagas in flight: threads, each its own middleware")
    parser.add_argument("--sagas-dir", default=os.path.join(os.path.dirname(__file__), "../../../sagas"))
    parser.add_argument("--batch-abort", action="store_true", help="agent mode: keep the batch-abort gate on")
    args = parser.parse_args()
    # The middleware logs every failure and rollback at ERROR on the root logger; dropped here,
    # so that the rate is the machinery's and not stderr's (this favours the peer).
    logging.disable(logging.CRITICAL)
    with open(os.path.join(args.sagas_dir, "ct1-payment-failure.fixture.json")) as f:
        fixture = json.load(f)
    with open(os.path.join(args.sagas_dir, "ct1-payment-failure.input.json")) as f:
        trip = json.load(f)
    STORE.update(copy.deepcopy(fixture))
    run = run_middleware if args.mode == "middleware" else functools.partial(run_agent, batch_abort=args.batch_abort)

    run(trip, max(args.sagas // 20, 5), 0)  # warm-up: imports, lazy strategies, caches
    per_thread = args.sagas // args.threads
    failures = []

    def worker(t):
        try:
            run(trip, per_thread, (t + 1) * 10**9)
        except BaseException as e:  # noqa: BLE001 - reported below, the run fails
            failures.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(args.threads)]
    started, cpu = time.perf_counter(), time.process_time()
    if args.threads == 1:
        worker(0)  # in the main thread, as a one-request-at-a-time agent runs
    else:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    if failures:
        raise SystemExit(f"a saga failed: {failures[0]}")
    # Every booking was undone: the store is the fixture again (empty namespaces aside).
    after = {ns: docs for ns, docs in STORE.items() if docs and ns != "payment_ledger"}
    if after != fixture:
        changed = sorted(ns for ns in set(after) | set(fixture) if after.get(ns) != fixture.get(ns))
        raise SystemExit(f"the store differs from the fixture after the rollbacks in: {changed}")
    done = per_thread * args.threads
    print(
        json.dumps(
            {
                "peer": "langchain-compensation",
                "version": "0.5.8",
                "mode": args.mode,
                "saga": "ct1-payment-failure",
                "sagas": done,
                "threads": args.threads,
                "seconds": round(elapsed, 4),
                "cpu_seconds": round(cpu, 4),
                "sagas_per_second": round(done / elapsed, 1),
                "sagas_per_cpu_second": round(done / cpu, 1),
                "python": sys.version.split()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
