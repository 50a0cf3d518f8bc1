//! A sagabox tool plugin in Rust: spends from budgets kept in the host's store.
//!
//! - `spend {budget, amount}` takes `amount` from `budgets/<budget>` and records the spend as
//!   `spends/<spend id>`, the id derived from the call's idempotency key: a second delivery of
//!   the same step finds its record and changes nothing.
//! - `refund` (the compensator of `spend`) gives a spend back and deletes its record; refunding
//!   twice, or refunding what never happened, changes nothing.
//! - `balance {budget}` reads a budget and writes nothing.
//!
//! Errors: return `Err(ToolError::InvalidInput | Rejected | Transient(why))` from `call`.

wit_bindgen::generate!({ path: "wit", world: "plugin" });

use exports::sagabox::plugin::tool::{CallContext, Guest, ToolError, ToolInfo};
use sagabox::plugin::log::{Level, log};
use sagabox::plugin::store::{self, StoreError};
use serde_json::{Value, json};

struct Plugin;

/// A store error as a tool error (an unavailable store is worth a retry).
fn store_error(op: &str, error: StoreError) -> ToolError {
    match error {
        StoreError::Unavailable(why) => ToolError::Transient(format!("store unavailable: {why}")),
        StoreError::InvalidDocument(why) | StoreError::QuotaExceeded(why) => {
            ToolError::InvalidInput(format!("store {op} failed: {why}"))
        }
    }
}

fn get_doc(namespace: &str, key: &str) -> Result<Option<Value>, ToolError> {
    let text = store::get(namespace, key).map_err(|e| store_error("get", e))?;
    text.map(|t| serde_json::from_str(&t).map_err(|e| ToolError::InvalidInput(format!("{namespace}/{key}: {e}"))))
        .transpose()
}

fn put_doc(namespace: &str, key: &str, doc: &Value) -> Result<(), ToolError> {
    store::put(namespace, key, &doc.to_string()).map_err(|e| store_error("put", e))
}

/// The id of the spend a call with this idempotency key records.
fn spend_id(idempotency_key: &str) -> String {
    format!("S{}", idempotency_key[..idempotency_key.len().min(16)].to_ascii_uppercase())
}

fn number(doc: &Value, field: &str) -> i64 {
    doc[field].as_i64().unwrap_or(0)
}

fn budget_of(name: &str) -> Result<Value, ToolError> {
    let budget = get_doc("budgets", name)?.ok_or_else(|| ToolError::Rejected(format!("no budget named '{name}'")))?;
    if budget["locked"].as_bool() == Some(true) {
        return Err(ToolError::Transient(format!("budget '{name}' is locked for reconciliation; try again")));
    }
    Ok(budget)
}

fn spend(args: &Value, context: &CallContext) -> Result<Value, ToolError> {
    let name = args["budget"].as_str().ok_or_else(|| ToolError::InvalidInput("'budget' must be a string".into()))?;
    let amount = args["amount"]
        .as_i64()
        .filter(|a| *a >= 1)
        .ok_or_else(|| ToolError::InvalidInput("'amount' must be a positive integer".into()))?;
    let id = spend_id(&context.idempotency_key);
    if let Some(done) = get_doc("spends", &id)? {
        return Ok(json!({ "spend_id": id, "budget": done["budget"], "remaining": done["remaining"] }));
    }
    let mut budget = budget_of(name)?;
    let (limit, spent) = (number(&budget, "limit"), number(&budget, "spent"));
    let remaining = limit - spent - amount;
    if remaining < 0 {
        return Err(ToolError::Rejected(format!("budget '{name}' has {} left, {amount} asked", limit - spent)));
    }
    budget["spent"] = json!(spent + amount);
    put_doc("budgets", name, &budget)?;
    put_doc(
        "spends",
        &id,
        &json!({ "budget": name, "amount": amount, "remaining": remaining, "step": context.step_id }),
    )?;
    log(Level::Info, &format!("spent {amount} from {name}"));
    Ok(json!({ "spend_id": id, "budget": name, "remaining": remaining }))
}

fn refund(args: &Value) -> Result<Value, ToolError> {
    let forward = &args["forward"];
    let id = args["spend_id"]
        .as_str()
        .or(forward["output"]["spend_id"].as_str())
        .map(str::to_string)
        .or_else(|| forward["idempotency_key"].as_str().map(spend_id))
        .ok_or_else(|| ToolError::InvalidInput("need 'spend_id' or the forward call it undoes".into()))?;
    let Some(done) = get_doc("spends", &id)? else {
        return Ok(json!({ "refunded": false, "spend_id": id }));
    };
    let name = done["budget"].as_str().unwrap_or_default();
    if let Some(mut budget) = get_doc("budgets", name)? {
        budget["spent"] = json!(number(&budget, "spent") - number(&done, "amount"));
        put_doc("budgets", name, &budget)?;
    }
    store::delete("spends", &id).map_err(|e| store_error("delete", e))?;
    Ok(json!({ "refunded": true, "spend_id": id }))
}

fn balance(args: &Value) -> Result<Value, ToolError> {
    let name = args["budget"].as_str().ok_or_else(|| ToolError::InvalidInput("'budget' must be a string".into()))?;
    let budget = budget_of(name)?;
    let (limit, spent) = (number(&budget, "limit"), number(&budget, "spent"));
    Ok(json!({ "budget": name, "limit": limit, "spent": spent, "left": limit - spent }))
}

fn info(name: &str, description: &str, schema: Value, compensator: Option<&str>, side_effects: bool) -> ToolInfo {
    ToolInfo {
        name: name.into(),
        description: description.into(),
        args_schema: schema.to_string(),
        compensator: compensator.map(Into::into),
        side_effects,
    }
}

impl Guest for Plugin {
    fn manifest() -> Vec<ToolInfo> {
        let spend_schema = json!({
            "type": "object",
            "properties": { "budget": { "type": "string" }, "amount": { "type": "integer", "minimum": 1 } },
            "required": ["budget", "amount"]
        });
        let refund_schema = json!({
            "type": "object",
            "properties": {
                "spend_id": { "type": "string" },
                "forward": {
                    "type": "object",
                    "properties": {
                        "arguments": { "type": "object" }, "output": {}, "idempotency_key": { "type": "string" }
                    }
                }
            },
            "anyOf": [{ "required": ["spend_id"] }, { "required": ["forward"] }]
        });
        let balance_schema =
            json!({ "type": "object", "properties": { "budget": { "type": "string" } }, "required": ["budget"] });
        vec![
            info(
                "spend",
                "Spends `amount` from the budget `budget`; refused when the budget cannot cover it.",
                spend_schema,
                Some("refund"),
                true,
            ),
            info("refund", "Gives back one spend (the compensator of `spend`).", refund_schema, None, true),
            info("balance", "Returns what is left of the budget `budget`.", balance_schema, None, false),
        ]
    }

    fn call(name: String, args: String, context: CallContext) -> Result<String, ToolError> {
        let args: Value =
            serde_json::from_str(&args).map_err(|e| ToolError::InvalidInput(format!("arguments are not JSON: {e}")))?;
        let output = match name.as_str() {
            "spend" => spend(&args, &context)?,
            "refund" => refund(&args)?,
            "balance" => balance(&args)?,
            other => return Err(ToolError::InvalidInput(format!("no tool named '{other}'"))),
        };
        Ok(output.to_string())
    }
}

export!(Plugin);
