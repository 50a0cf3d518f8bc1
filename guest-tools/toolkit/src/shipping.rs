//! Shipments: `carriers/<carrier_id>` with `capacity.<date>` slots left, and `shipments/<id>`.

use serde_json::{Value, json};

use crate::common::{
    Args, Context, Plugin, Store, StoreExt, ToolError, ToolSpec, compensator_schema, count_of, nothing_to_undo,
    record_id, undo_target, unknown_tool,
};

pub struct Shipping;

impl Plugin for Shipping {
    fn manifest() -> Vec<ToolSpec> {
        vec![
            ToolSpec::action(
                "schedule",
                "Books a carrier's pick-up slot for an order on a date; returns the tracking number.",
                json!({
                    "type": "object",
                    "properties": {
                        "order_id": { "type": "string" },
                        "carrier_id": { "type": "string" },
                        "date": { "type": "string" },
                        "address": { "type": "string" }
                    },
                    "required": ["order_id", "carrier_id", "date"]
                }),
                "cancel",
            ),
            ToolSpec::undo(
                "cancel",
                "Cancels a shipment and frees its pick-up slot.",
                compensator_schema("shipment_id"),
            ),
        ]
    }

    fn call(store: &mut dyn Store, tool: &str, args: &Value, ctx: &Context) -> Result<Value, ToolError> {
        match tool {
            "schedule" => schedule(store, args, ctx),
            "cancel" => cancel(store, args),
            other => Err(unknown_tool(other)),
        }
    }
}

fn schedule(store: &mut dyn Store, args: &Value, ctx: &Context) -> Result<Value, ToolError> {
    let a = Args(args);
    let (order_id, carrier_id, date) = (a.str("order_id")?, a.str("carrier_id")?, a.str("date")?);
    let id = record_id("S", &ctx.idempotency_key);
    if let Some(existing) = store.doc("shipments", &id)? {
        return Ok(confirmation(&existing));
    }
    let mut carrier = store.existing("carriers", carrier_id, "carrier")?;
    let slots = count_of(&carrier["capacity"], date);
    if slots == 0 {
        return Err(ToolError::Rejected(format!("carrier {carrier_id} has no pick-up slot on {date}")));
    }
    carrier["capacity"][date] = json!(slots - 1);
    let shipment = json!({
        "shipment_id": id,
        "order_id": order_id,
        "carrier_id": carrier_id,
        "date": date,
        "address": a.opt_str("address"),
        "tracking_number": format!("{carrier_id}-{id}"),
    });
    store.put_doc("carriers", carrier_id, &carrier)?;
    store.put_doc("shipments", &id, &shipment)?;
    Ok(confirmation(&shipment))
}

fn confirmation(shipment: &Value) -> Value {
    json!({
        "shipment_id": shipment["shipment_id"],
        "confirmationNumber": shipment["shipment_id"],
        "tracking_number": shipment["tracking_number"],
        "date": shipment["date"],
    })
}

fn cancel(store: &mut dyn Store, args: &Value) -> Result<Value, ToolError> {
    let id = undo_target(args, "shipment_id", "S")?;
    let Some(shipment) = store.doc("shipments", &id)? else {
        return Ok(nothing_to_undo(&id));
    };
    let carrier_id = shipment["carrier_id"].as_str().unwrap_or_default();
    let date = shipment["date"].as_str().unwrap_or_default();
    if let Some(mut carrier) = store.doc("carriers", carrier_id)? {
        carrier["capacity"][date] = json!(count_of(&carrier["capacity"], date) + 1);
        store.put_doc("carriers", carrier_id, &carrier)?;
    }
    store.delete("shipments", &id)?;
    Ok(json!({ "undone": true, "id": id }))
}
