//! Capacity pools: `pools/<pool_id>` with `capacity` and `allocated`, and `allocations/<id>`.

use serde_json::{Value, json};

use crate::common::{
    Args, Context, Plugin, Store, StoreExt, ToolError, ToolSpec, compensator_schema, count_of, nothing_to_undo,
    record_id, undo_target, unknown_tool,
};

pub struct Resources;

impl Plugin for Resources {
    fn manifest() -> Vec<ToolSpec> {
        vec![
            ToolSpec::action(
                "allocate",
                "Allocates units from a capacity pool; refused when the pool would overflow.",
                json!({
                    "type": "object",
                    "properties": {
                        "pool_id": { "type": "string" },
                        "amount": { "type": "integer", "minimum": 1 },
                        "owner": { "type": "string" }
                    },
                    "required": ["pool_id", "amount"]
                }),
                "release",
            ),
            ToolSpec::undo(
                "release",
                "Returns an allocation's units to its pool.",
                compensator_schema("allocation_id"),
            ),
        ]
    }

    fn call(store: &mut dyn Store, tool: &str, args: &Value, ctx: &Context) -> Result<Value, ToolError> {
        match tool {
            "allocate" => allocate(store, args, ctx),
            "release" => release(store, args),
            other => Err(unknown_tool(other)),
        }
    }
}

fn allocate(store: &mut dyn Store, args: &Value, ctx: &Context) -> Result<Value, ToolError> {
    let a = Args(args);
    let pool_id = a.str("pool_id")?;
    let amount = a.count("amount", 1)?;
    let id = record_id("A", &ctx.idempotency_key);
    if let Some(existing) = store.doc("allocations", &id)? {
        return Ok(confirmation(&existing));
    }
    let mut pool = store.existing("pools", pool_id, "pool")?;
    let (capacity, allocated) = (count_of(&pool, "capacity"), count_of(&pool, "allocated"));
    if allocated + amount > capacity {
        return Err(ToolError::Rejected(format!(
            "pool {pool_id} has {} of {capacity} free, {amount} asked",
            capacity.saturating_sub(allocated)
        )));
    }
    pool["allocated"] = json!(allocated + amount);
    let allocation = json!({
        "allocation_id": id,
        "pool_id": pool_id,
        "amount": amount,
        "owner": a.opt_str("owner"),
        "remaining": capacity - allocated - amount,
    });
    store.put_doc("pools", pool_id, &pool)?;
    store.put_doc("allocations", &id, &allocation)?;
    Ok(confirmation(&allocation))
}

fn confirmation(allocation: &Value) -> Value {
    json!({
        "allocation_id": allocation["allocation_id"],
        "confirmationNumber": allocation["allocation_id"],
        "amount": allocation["amount"],
        "remaining": allocation["remaining"],
    })
}

fn release(store: &mut dyn Store, args: &Value) -> Result<Value, ToolError> {
    let id = undo_target(args, "allocation_id", "A")?;
    let Some(allocation) = store.doc("allocations", &id)? else {
        return Ok(nothing_to_undo(&id));
    };
    let pool_id = allocation["pool_id"].as_str().unwrap_or_default();
    if let Some(mut pool) = store.doc("pools", pool_id)? {
        pool["allocated"] = json!(count_of(&pool, "allocated").saturating_sub(count_of(&allocation, "amount")));
        store.put_doc("pools", pool_id, &pool)?;
    }
    store.delete("allocations", &id)?;
    Ok(json!({ "undone": true, "id": id }))
}
