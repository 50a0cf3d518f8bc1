//! Payments against the payment methods of tau-bench's `users` (gift cards with a `balance`
//! or `amount`, certificates with an `amount`, cards with an optional `available_credit` of
//! our own). `payments/<id>` holds open charges; `payment_ledger` is an append-only audit
//! trail of every charge and refund.

use serde_json::{Value, json};

use crate::common::{
    Args, Context, Plugin, Store, StoreExt, ToolError, ToolSpec, compensator_schema, from_cents, nothing_to_undo,
    record_id, to_cents, undo_target, unknown_tool,
};
use crate::docs::Docs;

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
    // The user stays text: the payment method is read and its funds replaced in place.
    let mut docs = Docs::new(store, false);
    if let Some(existing) = docs.load("payments", &id)? {
        return Ok(receipt(&existing));
    }
    if !docs.exists("users", user_id)? {
        return Err(ToolError::Rejected(format!("no user '{user_id}'")));
    }
    let method = docs
        .at("users", user_id, &["payment_methods", method_id])?
        .ok_or_else(|| ToolError::Rejected(format!("user {user_id} has no payment method '{method_id}'")))?;
    if method["status"] == "blocked" {
        return Err(ToolError::Rejected(format!("payment declined: {method_id} is blocked")));
    }
    let field = funds_field(&method);
    if let Some(field) = field {
        let funds = to_cents(&method[field]).unwrap_or(0);
        if funds < amount {
            return Err(ToolError::Rejected(format!(
                "payment declined: {method_id} has {} left, {} asked",
                from_cents(funds),
                from_cents(amount)
            )));
        }
        docs.set("users", user_id, &["payment_methods", method_id, field], Some(from_cents(funds - amount)))?;
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
    let (output, entry) = (receipt(&payment), ledger_entry(&payment, "charge", ctx));
    docs.create("payments", &id, payment)?;
    docs.flush()?;
    store.put_doc("payment_ledger", &format!("{id}:charge"), &entry)?;
    Ok(output)
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
    let mut docs = Docs::new(store, false);
    let Some(payment) = docs.load("payments", &id)? else {
        return Ok(nothing_to_undo(&id));
    };
    let user_id = payment["user_id"].as_str().unwrap_or_default();
    let method_id = payment["payment_method_id"].as_str().unwrap_or_default();
    if let Some(field) = payment["funds_field"].as_str() {
        // Nothing is put back when the user or the payment method is gone.
        let path = ["payment_methods", method_id, field];
        let funds = docs.at("users", user_id, &path)?.as_ref().and_then(to_cents).unwrap_or(0);
        let refunded = from_cents(funds + to_cents(&payment["amount"]).unwrap_or(0));
        docs.set("users", user_id, &path, Some(refunded))?;
    }
    docs.remove("payments", &id)?;
    docs.flush()?;
    store.put_doc("payment_ledger", &format!("{id}:refund"), &ledger_entry(&payment, "refund", ctx))?;
    Ok(json!({ "undone": true, "id": id }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MapStore;
    use crate::common::call_with_key;

    const USER: &str = r#"{"payment_methods":{"card":{"available_credit":100,"source":"credit_card"},"gift":{"amount":50,"source":"gift_card"}},"user_id":"mia"}"#;

    /// A charge moves one balance in the user's text; its refund restores the user byte for
    /// byte and leaves both entries in the ledger.
    #[test]
    fn a_charge_and_its_refund_move_one_balance_and_restore_every_byte() {
        let mut store = MapStore::default();
        store.put("users", "mia", USER).unwrap();
        let charge = json!({"user_id": "mia", "payment_method_id": "gift", "amount": 12.25});
        let paid = call_with_key::<Payment>(&mut store, "charge", charge, "k1").unwrap();
        assert_eq!(
            store.get("users", "mia").unwrap().unwrap(),
            USER.replacen(r#""amount":50"#, r#""amount":37.75"#, 1)
        );
        let declined = json!({"user_id": "mia", "payment_method_id": "gift", "amount": 40});
        match call_with_key::<Payment>(&mut store, "charge", declined, "k2") {
            Err(ToolError::Rejected(message)) => {
                assert!(message.contains("gift has 37.75 left, 40 asked"), "{message}")
            }
            other => panic!("{other:?}"),
        }
        let refund = json!({"payment_id": paid["payment_id"]});
        assert_eq!(call_with_key::<Payment>(&mut store, "refund", refund, "k3").unwrap()["undone"], true);
        assert_eq!(store.get("users", "mia").unwrap().unwrap(), USER);
        let id = paid["payment_id"].as_str().unwrap();
        assert_eq!(store.list("payment_ledger", "").unwrap(), [format!("{id}:charge"), format!("{id}:refund")]);
        assert_eq!(store.get("payments", id).unwrap(), None);
    }
}
