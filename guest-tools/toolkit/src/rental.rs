//! Car rental: `rental_offices/<office_id>` with `city` and `fleet.<category>.{available,
//! daily_rate}`, and `rentals/<id>`. An office is chosen by the city in the drop-off address.

use serde_json::{Value, json};

use crate::common::{
    Args, Context, Plugin, Store, StoreExt, ToolError, ToolSpec, compensator_schema, count_of, from_cents,
    nothing_to_undo, record_id, to_cents, undo_target, unknown_tool,
};

pub struct Rental;

impl Plugin for Rental {
    fn manifest() -> Vec<ToolSpec> {
        vec![
            ToolSpec::action(
                "book",
                "Books a car at the office serving the hotel's city, picked up at the flight's arrival.",
                json!({
                    "type": "object",
                    "properties": {
                        "flightArrival": { "type": "string" },
                        "hotelAddress": { "type": "string" },
                        "office_id": { "type": "string" },
                        "category": { "type": "string" },
                        "days": { "type": "integer", "minimum": 1, "maximum": 90 }
                    },
                    "required": ["flightArrival"],
                    "anyOf": [ { "required": ["hotelAddress"] }, { "required": ["office_id"] } ]
                }),
                "cancel",
            ),
            ToolSpec::undo(
                "cancel",
                "Cancels a car rental and returns the car to the fleet.",
                compensator_schema("confirmationNumber"),
            ),
        ]
    }

    fn call(store: &mut dyn Store, tool: &str, args: &Value, ctx: &Context) -> Result<Value, ToolError> {
        match tool {
            "book" => book(store, args, ctx),
            "cancel" => cancel(store, args),
            other => Err(unknown_tool(other)),
        }
    }
}

/// The office named in the arguments, or the first (by id) whose city the address mentions.
fn choose_office(store: &mut dyn Store, a: &Args) -> Result<(String, Value), ToolError> {
    if let Some(id) = a.opt_str("office_id") {
        return Ok((id.to_string(), store.existing("rental_offices", id, "rental office")?));
    }
    let address = a.str("hotelAddress")?.to_lowercase();
    for id in store.list("rental_offices", "")? {
        let Some(office) = store.doc("rental_offices", &id)? else { continue };
        let city = office["city"].as_str().unwrap_or_default().to_lowercase();
        if !city.is_empty() && address.contains(&city) {
            return Ok((id, office));
        }
    }
    Err(ToolError::Rejected(format!("no rental office serves '{address}'")))
}

fn book(store: &mut dyn Store, args: &Value, ctx: &Context) -> Result<Value, ToolError> {
    let a = Args(args);
    let pickup = a.str("flightArrival")?;
    let category = a.opt_str("category").unwrap_or("compact");
    let days = a.count("days", 1)?;
    let id = record_id("C", &ctx.idempotency_key);
    if let Some(existing) = store.doc("rentals", &id)? {
        return Ok(confirmation(&existing));
    }

    let (office_id, mut office) = choose_office(store, &a)?;
    let car = office["fleet"]
        .get_mut(category)
        .ok_or_else(|| ToolError::Rejected(format!("office {office_id} rents no '{category}' cars")))?;
    let available = count_of(car, "available");
    if available == 0 {
        return Err(ToolError::Rejected(format!("office {office_id} has no {category} car left")));
    }
    car["available"] = json!(available - 1);
    let total = to_cents(&car["daily_rate"]).unwrap_or(0) * days as i64;
    let rental = json!({
        "rental_id": id,
        "office_id": office_id,
        "category": category,
        "pickup_time": pickup,
        "dropoff_address": a.opt_str("hotelAddress"),
        "days": days,
        "total_price": from_cents(total),
    });
    store.put_doc("rental_offices", &office_id, &office)?;
    store.put_doc("rentals", &id, &rental)?;
    Ok(confirmation(&rental))
}

fn confirmation(rental: &Value) -> Value {
    json!({
        "confirmationNumber": rental["rental_id"],
        "office_id": rental["office_id"],
        "category": rental["category"],
        "pickupTime": rental["pickup_time"],
        "total_price": rental["total_price"],
    })
}

fn cancel(store: &mut dyn Store, args: &Value) -> Result<Value, ToolError> {
    let id = undo_target(args, "confirmationNumber", "C")?;
    let Some(rental) = store.doc("rentals", &id)? else {
        return Ok(nothing_to_undo(&id));
    };
    let office_id = rental["office_id"].as_str().unwrap_or_default();
    let category = rental["category"].as_str().unwrap_or_default();
    if let Some(mut office) = store.doc("rental_offices", office_id)?
        && let Some(car) = office["fleet"].get_mut(category)
    {
        car["available"] = json!(count_of(car, "available") + 1);
        store.put_doc("rental_offices", office_id, &office)?;
    }
    store.delete("rentals", &id)?;
    Ok(json!({ "undone": true, "id": id }))
}
