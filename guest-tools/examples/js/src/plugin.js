// A sagabox tool plugin in JavaScript: spends from budgets kept in the host's store.
//
// - `spend {budget, amount}` takes `amount` from `budgets/<budget>` and records the spend as
//   `spends/<spend id>`, the id derived from the call's idempotency key: a second delivery of
//   the same step finds its record and changes nothing.
// - `refund` (the compensator of `spend`) gives a spend back and deletes its record; refunding
//   twice, or refunding what never happened, changes nothing.
// - `balance {budget}` reads a budget and writes nothing.
//
// Errors: throw `{ tag: "invalid-input" | "rejected" | "transient", val: "why" }` from `call`.

import * as store from "sagabox:plugin/store@0.1.0";
import { log } from "sagabox:plugin/log@0.1.0";

const SPEND_SCHEMA = {
  type: "object",
  properties: {
    budget: { type: "string" },
    amount: { type: "integer", minimum: 1 },
  },
  required: ["budget", "amount"],
};

const REFUND_SCHEMA = {
  type: "object",
  properties: {
    spend_id: { type: "string" },
    forward: {
      type: "object",
      properties: { arguments: { type: "object" }, output: {}, idempotency_key: { type: "string" } },
    },
  },
  anyOf: [{ required: ["spend_id"] }, { required: ["forward"] }],
};

const BALANCE_SCHEMA = {
  type: "object",
  properties: { budget: { type: "string" } },
  required: ["budget"],
};

// The three kinds of tool error (see `tool-error` in wit/plugin.wit).
const invalidInput = (why) => ({ tag: "invalid-input", val: why });
const rejected = (why) => ({ tag: "rejected", val: why });
const transient = (why) => ({ tag: "transient", val: why });

// A store call; a store error becomes a tool error (an unavailable store is worth a retry).
function storeCall(op, ...args) {
  try {
    return store[op](...args);
  } catch (e) {
    const error = e.payload ?? e;
    if (error.tag === "unavailable") throw transient(`store unavailable: ${error.val}`);
    throw invalidInput(`store ${op} failed: ${error.tag}: ${error.val}`);
  }
}

function getDoc(namespace, key) {
  const text = storeCall("get", namespace, key);
  return text === undefined || text === null ? null : JSON.parse(text);
}

function putDoc(namespace, key, doc) {
  storeCall("put", namespace, key, JSON.stringify(doc));
}

// The id of the spend a call with this idempotency key records.
function spendId(idempotencyKey) {
  return "S" + idempotencyKey.slice(0, 16).toUpperCase();
}

function budgetOf(name) {
  const budget = getDoc("budgets", name);
  if (budget === null) throw rejected(`no budget named '${name}'`);
  if (budget.locked) throw transient(`budget '${name}' is locked for reconciliation; try again`);
  return budget;
}

function spend(args, context) {
  const { budget: name, amount } = args;
  if (!Number.isInteger(amount) || amount < 1) throw invalidInput("'amount' must be a positive integer");
  const id = spendId(context.idempotencyKey);
  const done = getDoc("spends", id);
  if (done !== null) return { spend_id: id, budget: done.budget, remaining: done.remaining };
  const budget = budgetOf(name);
  const remaining = budget.limit - budget.spent - amount;
  if (remaining < 0) {
    throw rejected(`budget '${name}' has ${budget.limit - budget.spent} left, ${amount} asked`);
  }
  putDoc("budgets", name, { ...budget, spent: budget.spent + amount });
  putDoc("spends", id, { budget: name, amount, remaining, step: context.stepId });
  log("info", `spent ${amount} from ${name}`);
  return { spend_id: id, budget: name, remaining };
}

function refund(args) {
  const forward = args.forward ?? {};
  const id =
    args.spend_id ??
    forward.output?.spend_id ??
    (forward.idempotency_key ? spendId(forward.idempotency_key) : undefined);
  if (id === undefined) throw invalidInput("need 'spend_id' or the forward call it undoes");
  const done = getDoc("spends", id);
  if (done === null) return { refunded: false, spend_id: id };
  const budget = getDoc("budgets", done.budget);
  if (budget !== null) putDoc("budgets", done.budget, { ...budget, spent: budget.spent - done.amount });
  storeCall("delete", "spends", id);
  return { refunded: true, spend_id: id };
}

function balance(args) {
  const budget = budgetOf(args.budget);
  return { budget: args.budget, limit: budget.limit, spent: budget.spent, left: budget.limit - budget.spent };
}

export const tool = {
  manifest() {
    return [
      {
        name: "spend",
        description: "Spends `amount` from the budget `budget`; refused when the budget cannot cover it.",
        argsSchema: JSON.stringify(SPEND_SCHEMA),
        compensator: "refund",
        sideEffects: true,
      },
      {
        name: "refund",
        description: "Gives back one spend (the compensator of `spend`).",
        argsSchema: JSON.stringify(REFUND_SCHEMA),
        compensator: undefined,
        sideEffects: true,
      },
      {
        name: "balance",
        description: "Returns what is left of the budget `budget`.",
        argsSchema: JSON.stringify(BALANCE_SCHEMA),
        compensator: undefined,
        sideEffects: false,
      },
    ];
  },

  call(name, argsText, context) {
    let args;
    try {
      args = JSON.parse(argsText);
    } catch (e) {
      throw invalidInput(`arguments are not JSON: ${e}`);
    }
    switch (name) {
      case "spend":
        return JSON.stringify(spend(args, context));
      case "refund":
        return JSON.stringify(refund(args));
      case "balance":
        return JSON.stringify(balance(args));
      default:
        throw invalidInput(`no tool named '${name}'`);
    }
  },
};
