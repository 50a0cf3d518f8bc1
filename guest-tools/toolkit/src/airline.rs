//! Flights and reservations, in the shape of tau-bench's airline database:
//! `flights/<flight_number>` with `dates.<date>.available_seats.<cabin>` and `prices.<cabin>`,
//! `reservations/<reservation_id>`, and `users/<user_id>.reservations`.

use serde_json::{Value, json};

use crate::common::{
    Args, Context, Plugin, Store, StoreExt, ToolError, ToolSpec, compensator_schema, count_of, from_cents,
    nothing_to_undo, record_id, to_cents, undo_target, unknown_tool,
};

pub struct Airline;

const CABINS: [&str; 3] = ["basic_economy", "economy", "business"];

impl Plugin for Airline {
    fn manifest() -> Vec<ToolSpec> {
        vec![
            ToolSpec::query(
                "search",
                "Flights from origin to destination on a date, with seats left and prices.",
                json!({
                    "type": "object",
                    "properties": {
                        "origin": { "type": "string" },
                        "destination": { "type": "string" },
                        "date": { "type": "string" }
                    },
                    "required": ["origin", "destination", "date"]
                }),
            ),
            ToolSpec::action(
                "book",
                "Books seats on a flight; returns the confirmation number and arrival time.",
                json!({
                    "type": "object",
                    "properties": {
                        "flight_number": { "type": "string" },
                        "date": { "type": "string" },
                        "cabin": { "enum": CABINS },
                        "passengers": { "type": "integer", "minimum": 1, "maximum": 9 },
                        "user_id": { "type": "string" }
                    },
                    "required": ["flight_number", "date"]
                }),
                "cancel",
            ),
            ToolSpec::undo(
                "cancel",
                "Cancels a reservation and gives its seats back.",
                compensator_schema("confirmationNumber"),
            ),
        ]
    }

    fn call(store: &mut dyn Store, tool: &str, args: &Value, ctx: &Context) -> Result<Value, ToolError> {
        match tool {
            "search" => search(store, args),
            "book" => book(store, args, ctx),
            "cancel" => cancel(store, args, true),
            other => Err(unknown_tool(other)),
        }
    }
}

fn search(store: &mut dyn Store, args: &Value) -> Result<Value, ToolError> {
    let a = Args(args);
    let (origin, destination, date) = (a.str("origin")?, a.str("destination")?, a.str("date")?);
    let mut found = Vec::new();
    for number in store.list("flights", "")? {
        let Some(flight) = store.doc("flights", &number)? else { continue };
        if flight["origin"] != origin || flight["destination"] != destination {
            continue;
        }
        if let Some(day) = flight["dates"].get(date) {
            found.push(json!({
                "flight_number": number,
                "status": day["status"],
                "available_seats": day["available_seats"],
                "prices": day["prices"],
                "departure": flight["scheduled_departure_time_est"],
                "arrival": flight["scheduled_arrival_time_est"],
            }));
        }
    }
    Ok(json!({ "flights": found }))
}

fn book(store: &mut dyn Store, args: &Value, ctx: &Context) -> Result<Value, ToolError> {
    let a = Args(args);
    let number = a.str("flight_number")?;
    let date = a.str("date")?;
    let cabin = a.opt_str("cabin").unwrap_or("economy");
    if !CABINS.contains(&cabin) {
        return Err(ToolError::InvalidInput(format!("unknown cabin '{cabin}'")));
    }
    let passengers = a.count("passengers", 1)?;
    let id = record_id("R", &ctx.idempotency_key);
    if let Some(existing) = store.doc("reservations", &id)? {
        return Ok(confirmation(&existing));
    }

    let mut flight = store.existing("flights", number, "flight")?;
    let day = flight["dates"]
        .get_mut(date)
        .ok_or_else(|| ToolError::Rejected(format!("flight {number} does not fly on {date}")))?;
    if day["status"] != "available" {
        return Err(ToolError::Rejected(format!(
            "flight {number} on {date} is {}, not open for booking",
            day["status"]
        )));
    }
    let seats = count_of(&day["available_seats"], cabin);
    if seats < passengers {
        return Err(ToolError::Rejected(format!(
            "flight {number} on {date} has {seats} {cabin} seats left, {passengers} asked"
        )));
    }
    let price = to_cents(&day["prices"][cabin])
        .ok_or_else(|| ToolError::Rejected(format!("flight {number} has no {cabin} price")))?;
    day["available_seats"][cabin] = json!(seats - passengers);
    let arrival = format!("{date}T{}", flight["scheduled_arrival_time_est"].as_str().unwrap_or("00:00:00"));
    let reservation = json!({
        "reservation_id": id,
        "user_id": a.opt_str("user_id"),
        "origin": flight["origin"],
        "destination": flight["destination"],
        "flight_type": "one_way",
        "cabin": cabin,
        "flights": [{
            "flight_number": number,
            "date": date,
            "price": from_cents(price),
            "origin": flight["origin"],
            "destination": flight["destination"],
        }],
        "passengers": passengers,
        "total_price": from_cents(price * passengers as i64),
        "arrival_time": arrival,
        "status": "confirmed",
    });
    store.put_doc("flights", number, &flight)?;
    store.put_doc("reservations", &id, &reservation)?;
    if let Some(user_id) = a.opt_str("user_id") {
        link_user(store, user_id, &id, true)?;
    }
    Ok(confirmation(&reservation))
}

fn confirmation(reservation: &Value) -> Value {
    json!({
        "confirmationNumber": reservation["reservation_id"],
        "reservation_id": reservation["reservation_id"],
        "arrivalTime": reservation["arrival_time"],
        "cabin": reservation["cabin"],
        "passengers": reservation["passengers"],
        "total_price": reservation["total_price"],
    })
}

/// Cancels a reservation. `restore_seats` is false only in the deliberately buggy plugin that
/// reproduces a public benchmark's cancel, which never gave the seats back.
pub fn cancel(store: &mut dyn Store, args: &Value, restore_seats: bool) -> Result<Value, ToolError> {
    let id = undo_target(args, "confirmationNumber", "R")?;
    let Some(reservation) = store.doc("reservations", &id)? else {
        return Ok(nothing_to_undo(&id));
    };
    let cabin = reservation["cabin"].as_str().unwrap_or("economy");
    let passengers = count_of(&reservation, "passengers");
    if restore_seats {
        for segment in reservation["flights"].as_array().into_iter().flatten() {
            let number = segment["flight_number"].as_str().unwrap_or_default();
            let date = segment["date"].as_str().unwrap_or_default();
            let Some(mut flight) = store.doc("flights", number)? else { continue };
            if let Some(seats) = flight["dates"].get_mut(date).map(|d| &mut d["available_seats"][cabin]) {
                *seats = json!(seats.as_u64().unwrap_or(0) + passengers);
                store.put_doc("flights", number, &flight)?;
            }
        }
    }
    if let Some(user_id) = reservation["user_id"].as_str() {
        link_user(store, user_id, &id, false)?;
    }
    store.delete("reservations", &id)?;
    Ok(json!({ "undone": true, "id": id }))
}

/// Adds or removes a reservation id in the user's `reservations` list, if the user exists.
fn link_user(store: &mut dyn Store, user_id: &str, id: &str, add: bool) -> Result<(), ToolError> {
    let Some(mut user) = store.doc("users", user_id)? else { return Ok(()) };
    let Some(list) = user.get_mut("reservations").and_then(Value::as_array_mut) else {
        return Ok(());
    };
    let present = list.iter().any(|r| r == id);
    if add && !present {
        list.push(json!(id));
    } else if !add && present {
        list.retain(|r| r != id);
    } else {
        return Ok(());
    }
    store.put_doc("users", user_id, &user)
}
