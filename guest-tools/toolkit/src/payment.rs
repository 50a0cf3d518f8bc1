//! Payments against the payment methods of tau-bench's `users` (gift cards with a `balance`
//! or `amount`, certificates with an `amount`, cards with an optional `available_credit` of
//! our own). `payments/<id>` holds open charges; `payment_ledger` is an append-only audit
//! trail of every charge and refund.

use serde_json::{Value, json};

use crate::common::{
    Args, Context, Plugin, Store, StoreExt, ToolError, ToolSpec, compensator_schema, from_cents, nothing_to_undo,
    record_id, to_cents, undo_target, unknown_tool,
};

pub struct Payment;

impl Plugin for Payment {
    fn manifest() -> Vec<ToolSpec> {
        vec![
            ToolSpec::action(
                "charge",
                "Charges a user's payment method; declined when its balance or credit is short.",
                json!({
                    "type": "object",
                    "properties": {
                        "user_id": { "type": "string" },
                        "payment_method_id": { "type": "string" },
                        "amount": { "type": "number", "exclusiveMinimum": 0 },
                        "reference": { "type": "string" }
                    },
                    "required": ["user_id", "payment_method_id", "amount"]
                }),
                "refund",
            ),
            ToolSpec::undo(
                "refund",
                "Refunds a charge in full to the payment method it came from.",
                compensator_schema("payment_id"),
            ),
        ]
    }

    fn call(store: &mut dyn Store, tool: &str, args: &Value, ctx: &Context) -> Result<Value, ToolError> {
        match tool {
            "charge" => charge(store, args, ctx),
            "refund" => refund(store, args, ctx),
            other => Err(unknown_tool(other)),
        }
    }
}

/// The field of a payment method that holds the money it can still spend, if it is limited.
fn funds_field(method: &Value) -> Option<&'static str> {
    match method["source"].as_str() {
        Some("gift_card") if method.get("balance").is_some() => Some("balance"),
        Some("gift_card") | Some("certificate") => Some("amount"),
        _ if method.get("available_credit").is_some() => Some("available_credit"),
        _ => None,
    }
}

fn charge(store: &mut dyn Store, args: &Value, ctx: &Context) -> Result<Value, ToolError> {
    let a = Args(args);
    let user_id = a.str("user_id")?;
    let method_id = a.str("payment_method_id")?;
    let amount = a.cents("amount")?;
    let id = record_id("P", &ctx.idempotency_key);
    if let Some(existing) = store.doc("payments", &id)? {
        return Ok(receipt(&existing));
    }

    let mut user = store.existing("users", user_id, "user")?;
    let method = user["payment_methods"]
        .get_mut(method_id)
        .ok_or_else(|| ToolError::Rejected(format!("user {user_id} has no payment method '{method_id}'")))?;
    if method["status"] == "blocked" {
        return Err(ToolError::Rejected(format!("payment declined: {method_id} is blocked")));
    }
    let field = funds_field(method);
    if let Some(field) = field {
        let funds = to_cents(&method[field]).unwrap_or(0);
        if funds < amount {
            return Err(ToolError::Rejected(format!(
                "payment declined: {method_id} has {} left, {} asked",
                from_cents(funds),
                from_cents(amount)
            )));
        }
        method[field] = from_cents(funds - amount);
    }
    let payment = json!({
        "payment_id": id,
        "user_id": user_id,
        "payment_method_id": method_id,
        "funds_field": field,
        "amount": from_cents(amount),
        "reference": a.opt_str("reference"),
        "status": "charged",
    });
    store.put_doc("users", user_id, &user)?;
    store.put_doc("payments", &id, &payment)?;
    store.put_doc("payment_ledger", &format!("{id}:charge"), &ledger_entry(&payment, "charge", ctx))?;
    Ok(receipt(&payment))
}

fn receipt(payment: &Value) -> Value {
    json!({
        "payment_id": payment["payment_id"],
        "confirmationNumber": payment["payment_id"],
        "amount": payment["amount"],
        "status": payment["status"],
    })
}

fn ledger_entry(payment: &Value, kind: &str, ctx: &Context) -> Value {
    json!({
        "kind": kind,
        "payment_id": payment["payment_id"],
        "user_id": payment["user_id"],
        "payment_method_id": payment["payment_method_id"],
        "amount": payment["amount"],
        "saga_id": ctx.saga_id,
        "step_id": ctx.step_id,
    })
}

fn refund(store: &mut dyn Store, args: &Value, ctx: &Context) -> Result<Value, ToolError> {
    let id = undo_target(args, "payment_id", "P")?;
    let Some(payment) = store.doc("payments", &id)? else {
        return Ok(nothing_to_undo(&id));
    };
    let user_id = payment["user_id"].as_str().unwrap_or_default();
    let method_id = payment["payment_method_id"].as_str().unwrap_or_default();
    if let (Some(field), Some(mut user)) = (payment["funds_field"].as_str(), store.doc("users", user_id)?)
        && let Some(method) = user["payment_methods"].get_mut(method_id)
    {
        let funds = to_cents(&method[field]).unwrap_or(0);
        method[field] = from_cents(funds + to_cents(&payment["amount"]).unwrap_or(0));
        store.put_doc("users", user_id, &user)?;
    }
    store.delete("payments", &id)?;
    store.put_doc("payment_ledger", &format!("{id}:refund"), &ledger_entry(&payment, "refund", ctx))?;
    Ok(json!({ "undone": true, "id": id }))
}
