//! Flights and reservations, in the shape of tau-bench's airline database:
//! `flights/<flight_number>` with `dates.<date>.available_seats.<cabin>` and `prices.<cabin>`,
//! `reservations/<reservation_id>`, and `users/<user_id>.reservations`.

use serde_json::{Value, json};

use crate::common::{
    Args, Context, Plugin, Store, StoreExt, ToolError, ToolSpec, compensator_schema, count_of, from_cents,
    nothing_to_undo, record_id, to_cents, undo_target, unknown_tool,
};
use crate::docs::Docs;

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
    // The flight stays text: the day is read and its seat count replaced in place.
    let mut docs = Docs::new(store, false);
    if let Some(existing) = docs.load("reservations", &id)? {
        return Ok(confirmation(&existing));
    }
    if !docs.exists("flights", number)? {
        return Err(ToolError::Rejected(format!("no flight '{number}'")));
    }
    let day = docs
        .at("flights", number, &["dates", date])?
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
    docs.set("flights", number, &["dates", date, "available_seats", cabin], Some(json!(seats - passengers)))?;
    let [origin, destination, arrival] =
        docs.fields("flights", number, ["origin", "destination", "scheduled_arrival_time_est"])?;
    let (origin, destination) = (origin.unwrap_or(Value::Null), destination.unwrap_or(Value::Null));
    let arrival = format!("{date}T{}", arrival.as_ref().and_then(Value::as_str).unwrap_or("00:00:00"));
    let reservation = json!({
        "reservation_id": id,
        "user_id": a.opt_str("user_id"),
        "origin": origin,
        "destination": destination,
        "flight_type": "one_way",
        "cabin": cabin,
        "flights": [{
            "flight_number": number,
            "date": date,
            "price": from_cents(price),
            "origin": origin,
            "destination": destination,
        }],
        "passengers": passengers,
        "total_price": from_cents(price * passengers as i64),
        "arrival_time": arrival,
        "status": "confirmed",
    });
    let output = confirmation(&reservation);
    docs.create("reservations", &id, reservation)?;
    if let Some(user_id) = a.opt_str("user_id") {
        link_user(&mut docs, user_id, &id, true)?;
    }
    docs.flush()?;
    Ok(output)
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
    let mut docs = Docs::new(store, false);
    if !docs.exists("reservations", &id)? {
        return Ok(nothing_to_undo(&id));
    }
    let [cabin, passengers, flights, user_id] =
        docs.fields("reservations", &id, ["cabin", "passengers", "flights", "user_id"])?;
    let cabin = cabin.as_ref().and_then(Value::as_str).unwrap_or("economy");
    let passengers = passengers.as_ref().and_then(Value::as_u64).unwrap_or(0);
    if restore_seats {
        for segment in flights.as_ref().and_then(Value::as_array).into_iter().flatten() {
            let number = segment["flight_number"].as_str().unwrap_or_default();
            let date = segment["date"].as_str().unwrap_or_default();
            docs.add_to_count("flights", number, &["dates", date, "available_seats", cabin], passengers)?;
        }
    }
    if let Some(user_id) = user_id.as_ref().and_then(Value::as_str) {
        link_user(&mut docs, user_id, &id, false)?;
    }
    docs.remove("reservations", &id)?;
    docs.flush()?;
    Ok(json!({ "undone": true, "id": id }))
}

/// Adds or removes a reservation id in the user's `reservations` list, if the user exists.
fn link_user(docs: &mut Docs<'_>, user_id: &str, id: &str, add: bool) -> Result<(), ToolError> {
    let Some(Value::Array(mut list)) = docs.at("users", user_id, &["reservations"])? else {
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
    docs.set("users", user_id, &["reservations"], Some(Value::Array(list)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MapStore;
    use crate::common::call_with_key;

    const FLIGHT: &str = r#"{"dates":{"2024-05-16":{"available_seats":{"business":2,"economy":9},"prices":{"business":912,"economy":238.5},"status":"available"},"2024-05-17":{"available_seats":{"economy":3},"prices":{"economy":250},"status":"available"}},"destination":"JFK","origin":"SFO","scheduled_arrival_time_est":"14:30:00"}"#;
    const USER: &str = r#"{"name":"Mia","reservations":["4WQ150"],"user_id":"mia"}"#;

    /// A booking changes the text of the flight only where its seat count is, and its cancel
    /// gives back the flight and the user byte for byte.
    #[test]
    fn a_booking_moves_one_seat_count_in_the_text_and_its_cancel_restores_every_byte() {
        let mut store = MapStore::default();
        store.put("flights", "HAT001", FLIGHT).unwrap();
        store.put("users", "mia", USER).unwrap();
        let start = store.clone();
        let args = json!({"flight_number": "HAT001", "date": "2024-05-16", "passengers": 2, "user_id": "mia"});
        let booked = call_with_key::<Airline>(&mut store, "book", args.clone(), "k1").unwrap();
        assert_eq!(booked["total_price"], json!(477));
        let flight = store.get("flights", "HAT001").unwrap().unwrap();
        assert_eq!(flight, FLIGHT.replacen(r#""economy":9"#, r#""economy":7"#, 1));
        let user: Value = serde_json::from_str(&store.get("users", "mia").unwrap().unwrap()).unwrap();
        assert_eq!(user["reservations"], json!(["4WQ150", booked["confirmationNumber"]]));
        let reservation = store.get("reservations", booked["confirmationNumber"].as_str().unwrap()).unwrap();
        let reservation: Value = serde_json::from_str(&reservation.unwrap()).unwrap();
        assert_eq!((reservation["origin"].clone(), reservation["cabin"].clone()), (json!("SFO"), json!("economy")));
        assert_eq!(reservation["arrival_time"], "2024-05-16T14:30:00");
        // A second delivery replays the first one.
        assert_eq!(call_with_key::<Airline>(&mut store, "book", args, "k1").unwrap(), booked);
        assert_eq!(store.get("flights", "HAT001").unwrap().unwrap(), flight);

        let cancel = json!({"confirmationNumber": booked["confirmationNumber"]});
        assert_eq!(call_with_key::<Airline>(&mut store, "cancel", cancel.clone(), "k2").unwrap()["undone"], true);
        assert_eq!(store.0, start.0);
        assert_eq!(call_with_key::<Airline>(&mut store, "cancel", cancel, "k3").unwrap()["reason"], "nothing to undo");
    }

    /// A booking and its cancel read only the day they move seats on: another day nested past
    /// what a JSON parser takes (serde_json stops at 128 levels) is carried over untouched.
    /// Parsing the flight whole, as the tools did before, fails on it.
    #[test]
    fn a_booking_and_its_cancel_parse_only_the_day_they_touch() {
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        let flight = FLIGHT.replacen(r#""2024-05-17":"#, &format!(r#""2024-05-15":{deep},"2024-05-17":"#), 1);
        let mut store = MapStore::default();
        store.put("flights", "HAT001", &flight).unwrap();
        let start = store.clone();
        let args = json!({"flight_number": "HAT001", "date": "2024-05-16"});
        let booked = call_with_key::<Airline>(&mut store, "book", args, "k1").unwrap();
        let moved = flight.replacen(r#""economy":9"#, r#""economy":8"#, 1);
        assert_eq!(store.get("flights", "HAT001").unwrap().unwrap(), moved);
        let cancel = json!({"confirmationNumber": booked["confirmationNumber"]});
        call_with_key::<Airline>(&mut store, "cancel", cancel, "k2").unwrap();
        assert_eq!(store.0, start.0);
    }

    #[test]
    fn a_booking_is_refused_without_a_change_when_the_day_cannot_take_it() {
        let mut store = MapStore::default();
        store.put("flights", "HAT001", FLIGHT).unwrap();
        let start = store.clone();
        let refusals = [
            (json!({"flight_number": "HAT002", "date": "2024-05-16"}), "no flight 'HAT002'"),
            (json!({"flight_number": "HAT001", "date": "2024-05-18"}), "does not fly on 2024-05-18"),
            (json!({"flight_number": "HAT001", "date": "2024-05-17", "passengers": 4}), "has 3 economy seats left"),
            (json!({"flight_number": "HAT001", "date": "2024-05-17", "cabin": "business"}), "0 business seats"),
        ];
        for (args, why) in refusals {
            match call_with_key::<Airline>(&mut store, "book", args.clone(), "k") {
                Err(ToolError::Rejected(message)) => assert!(message.contains(why), "{args}: {message}"),
                other => panic!("{args}: {other:?}"),
            }
        }
        assert_eq!(store.0, start.0);
    }
}
