//! Hotel rooms: `hotels/<hotel_id>` with `dates.<date>.{rooms_available, price}`, and
//! `hotel_bookings/<id>`.

use serde_json::{Value, json};

use crate::common::{
    Args, Context, Plugin, Store, ToolError, ToolSpec, add_days, compensator_schema, count_of, from_cents,
    nothing_to_undo, record_id, to_cents, undo_target, unknown_tool,
};
use crate::docs::Docs;

pub struct Hotel;

impl Plugin for Hotel {
    fn manifest() -> Vec<ToolSpec> {
        vec![
            ToolSpec::action(
                "reserve",
                "Reserves rooms for consecutive nights; returns the confirmation number and the hotel's address.",
                json!({
                    "type": "object",
                    "properties": {
                        "hotel_id": { "type": "string" },
                        "check_in": { "type": "string" },
                        "nights": { "type": "integer", "minimum": 1, "maximum": 60 },
                        "rooms": { "type": "integer", "minimum": 1, "maximum": 20 },
                        "guest": { "type": "string" }
                    },
                    "required": ["hotel_id", "check_in"]
                }),
                "cancel",
            ),
            ToolSpec::undo(
                "cancel",
                "Cancels a hotel booking and frees its rooms.",
                compensator_schema("confirmationNumber"),
            ),
        ]
    }

    fn call(store: &mut dyn Store, tool: &str, args: &Value, ctx: &Context) -> Result<Value, ToolError> {
        match tool {
            "reserve" => reserve(store, args, ctx),
            "cancel" => cancel(store, args),
            other => Err(unknown_tool(other)),
        }
    }
}

fn nights_from(check_in: &str, nights: u64) -> Result<Vec<String>, ToolError> {
    (0..nights as i64)
        .map(|n| add_days(check_in, n))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| ToolError::InvalidInput(format!("'{check_in}' is not a YYYY-MM-DD date")))
}

fn reserve(store: &mut dyn Store, args: &Value, ctx: &Context) -> Result<Value, ToolError> {
    let a = Args(args);
    let hotel_id = a.str("hotel_id")?;
    let check_in = a.str("check_in")?;
    let rooms = a.count("rooms", 1)?;
    let nights = nights_from(check_in, a.count("nights", 1)?)?;
    let id = record_id("H", &ctx.idempotency_key);
    // The hotel stays text: each night is read and its free rooms replaced in place.
    let mut docs = Docs::new(store, false);
    if let Some(existing) = docs.load("hotel_bookings", &id)? {
        return Ok(confirmation(&existing));
    }
    if !docs.exists("hotels", hotel_id)? {
        return Err(ToolError::Rejected(format!("no hotel '{hotel_id}'")));
    }
    let mut total = 0;
    for night in &nights {
        let day = docs
            .at("hotels", hotel_id, &["dates", night])?
            .ok_or_else(|| ToolError::Rejected(format!("hotel {hotel_id} takes no bookings for {night}")))?;
        let free = count_of(&day, "rooms_available");
        if free < rooms {
            return Err(ToolError::Rejected(format!(
                "hotel {hotel_id} has {free} rooms free on {night}, {rooms} asked"
            )));
        }
        docs.set("hotels", hotel_id, &["dates", night, "rooms_available"], Some(json!(free - rooms)))?;
        total += to_cents(&day["price"]).unwrap_or(0) * rooms as i64;
    }
    let address = docs.at("hotels", hotel_id, &["address"])?.unwrap_or(Value::Null);
    let booking = json!({
        "booking_id": id,
        "hotel_id": hotel_id,
        "address": address,
        "nights": nights,
        "rooms": rooms,
        "guest": a.opt_str("guest"),
        "total_price": from_cents(total),
    });
    let output = confirmation(&booking);
    docs.create("hotel_bookings", &id, booking)?;
    docs.flush()?;
    Ok(output)
}

fn confirmation(booking: &Value) -> Value {
    json!({
        "confirmationNumber": booking["booking_id"],
        "address": booking["address"],
        "hotel_id": booking["hotel_id"],
        "nights": booking["nights"],
        "total_price": booking["total_price"],
    })
}

fn cancel(store: &mut dyn Store, args: &Value) -> Result<Value, ToolError> {
    let id = undo_target(args, "confirmationNumber", "H")?;
    let mut docs = Docs::new(store, false);
    let Some(booking) = docs.load("hotel_bookings", &id)? else {
        return Ok(nothing_to_undo(&id));
    };
    let hotel_id = booking["hotel_id"].as_str().unwrap_or_default();
    let rooms = count_of(&booking, "rooms");
    for night in booking["nights"].as_array().into_iter().flatten().filter_map(Value::as_str) {
        docs.add_to_count("hotels", hotel_id, &["dates", night, "rooms_available"], rooms)?;
    }
    docs.remove("hotel_bookings", &id)?;
    docs.flush()?;
    Ok(json!({ "undone": true, "id": id }))
}
