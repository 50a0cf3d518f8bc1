"""A sagabox tool plugin in Python: spends from budgets kept in the host's store.

- `spend {budget, amount}` takes `amount` from `budgets/<budget>` and records the spend as
  `spends/<spend id>`, the id derived from the call's idempotency key: a second delivery of
  the same step finds its record and changes nothing.
- `refund` (the compensator of `spend`) gives a spend back and deletes its record; refunding
  twice, or refunding what never happened, changes nothing.
- `balance {budget}` reads a budget and writes nothing.

Errors: raise `Err(ToolError_InvalidInput | ToolError_Rejected | ToolError_Transient("why"))`.
"""

import json

from componentize_py_types import Err
from wit_world import exports
from wit_world.exports.tool import (
    CallContext,
    ToolError_InvalidInput,
    ToolError_Rejected,
    ToolError_Transient,
    ToolInfo,
)
from wit_world.imports import log, store

SPEND_SCHEMA = {
    "type": "object",
    "properties": {
        "budget": {"type": "string"},
        "amount": {"type": "integer", "minimum": 1},
    },
    "required": ["budget", "amount"],
}

REFUND_SCHEMA = {
    "type": "object",
    "properties": {
        "spend_id": {"type": "string"},
        "forward": {
            "type": "object",
            "properties": {
                "arguments": {"type": "object"},
                "output": {},
                "idempotency_key": {"type": "string"},
            },
        },
    },
    "anyOf": [{"required": ["spend_id"]}, {"required": ["forward"]}],
}

BALANCE_SCHEMA = {
    "type": "object",
    "properties": {"budget": {"type": "string"}},
    "required": ["budget"],
}


# The three kinds of tool error (see `tool-error` in wit/plugin.wit).
def invalid_input(why: str) -> Err:
    return Err(ToolError_InvalidInput(why))


def rejected(why: str) -> Err:
    return Err(ToolError_Rejected(why))


def transient(why: str) -> Err:
    return Err(ToolError_Transient(why))


def store_call(op, *args):
    """A store call; a store error becomes a tool error (an unavailable store is worth a retry)."""
    try:
        return op(*args)
    except Err as e:
        if isinstance(e.value, store.StoreError_Unavailable):
            raise transient(f"store unavailable: {e.value.value}")
        raise invalid_input(f"store {op.__name__} failed: {e.value}")


def get_doc(namespace: str, key: str):
    text = store_call(store.get, namespace, key)
    return None if text is None else json.loads(text)


def put_doc(namespace: str, key: str, doc) -> None:
    store_call(store.put, namespace, key, json.dumps(doc))


def spend_id(idempotency_key: str) -> str:
    """The id of the spend a call with this idempotency key records."""
    return "S" + idempotency_key[:16].upper()


def budget_of(name: str):
    budget = get_doc("budgets", name)
    if budget is None:
        raise rejected(f"no budget named '{name}'")
    if budget.get("locked"):
        raise transient(f"budget '{name}' is locked for reconciliation; try again")
    return budget


def spend(args, context: CallContext):
    name, amount = args["budget"], args["amount"]
    if not isinstance(amount, int) or isinstance(amount, bool) or amount < 1:
        raise invalid_input("'amount' must be a positive integer")
    sid = spend_id(context.idempotency_key)
    done = get_doc("spends", sid)
    if done is not None:
        return {"spend_id": sid, "budget": done["budget"], "remaining": done["remaining"]}
    budget = budget_of(name)
    remaining = budget["limit"] - budget["spent"] - amount
    if remaining < 0:
        raise rejected(f"budget '{name}' has {budget['limit'] - budget['spent']} left, {amount} asked")
    put_doc("budgets", name, {**budget, "spent": budget["spent"] + amount})
    put_doc("spends", sid, {"budget": name, "amount": amount, "remaining": remaining, "step": context.step_id})
    log.log(log.Level.INFO, f"spent {amount} from {name}")
    return {"spend_id": sid, "budget": name, "remaining": remaining}


def refund(args):
    forward = args.get("forward") or {}
    sid = args.get("spend_id") or (forward.get("output") or {}).get("spend_id")
    if sid is None and forward.get("idempotency_key"):
        sid = spend_id(forward["idempotency_key"])
    if sid is None:
        raise invalid_input("need 'spend_id' or the forward call it undoes")
    done = get_doc("spends", sid)
    if done is None:
        return {"refunded": False, "spend_id": sid}
    budget = get_doc("budgets", done["budget"])
    if budget is not None:
        put_doc("budgets", done["budget"], {**budget, "spent": budget["spent"] - done["amount"]})
    store_call(store.delete, "spends", sid)
    return {"refunded": True, "spend_id": sid}


def balance(args):
    budget = budget_of(args["budget"])
    left = budget["limit"] - budget["spent"]
    return {"budget": args["budget"], "limit": budget["limit"], "spent": budget["spent"], "left": left}


class Tool(exports.Tool):
    def manifest(self):
        return [
            ToolInfo(
                name="spend",
                description="Spends `amount` from the budget `budget`; refused when the budget cannot cover it.",
                args_schema=json.dumps(SPEND_SCHEMA),
                compensator="refund",
                side_effects=True,
            ),
            ToolInfo(
                name="refund",
                description="Gives back one spend (the compensator of `spend`).",
                args_schema=json.dumps(REFUND_SCHEMA),
                compensator=None,
                side_effects=True,
            ),
            ToolInfo(
                name="balance",
                description="Returns what is left of the budget `budget`.",
                args_schema=json.dumps(BALANCE_SCHEMA),
                compensator=None,
                side_effects=False,
            ),
        ]

    def call(self, name: str, args: str, context: CallContext) -> str:
        try:
            parsed = json.loads(args)
        except ValueError as e:
            raise invalid_input(f"arguments are not JSON: {e}")
        if name == "spend":
            return json.dumps(spend(parsed, context))
        if name == "refund":
            return json.dumps(refund(parsed))
        if name == "balance":
            return json.dumps(balance(parsed))
        raise invalid_input(f"no tool named '{name}'")
