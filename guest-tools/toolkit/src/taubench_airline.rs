//! tau2-bench's airline tools (`AirlineTools` of the `tau2` package), with tau2's names,
//! arguments, refusals and effects, on tau2's airline database loaded unchanged: namespaces
//! `flights`, `users` and `reservations`, whose documents are keyed by flight number, user id
//! and reservation id.
//!
//! Every write tool has a compensator (`undo_<tool>`) that puts the database back as it was,
//! byte for byte, records that existed before included: a write records what it changed in
//! `taubench_airline_undo/<idempotency key>` (see [`crate::taubench`]), the compensator
//! undoes it, and a second delivery of a write replays the first one's output.
//!
//! Deliberate differences from tau2 (the README lists them too):
//! - new ids derive from the idempotency key: a reservation is the key's first 24 hex digits
//!   (upper case), a certificate `certificate_` and the same digits; tau2 takes the first free
//!   of `HATHAT`, `HATHAU`, `HATHAV` and `certificate_3221322`… (and refuses a fourth);
//! - `cancel_reservation` gives the seats of every passenger back on each flight of the
//!   reservation that is still bookable (tau2: "seats release not implemented"), once: a
//!   second cancel appends refunds as tau2 does but releases nothing;
//!   `update_reservation_flights` likewise gives back the seats of the flights it drops and
//!   takes seats on the flights it adds (tau2 leaves the flights untouched), so that seats are
//!   conserved through book, change and cancel;
//! - `search_onestop_flight` looks for the second leg of an overnight first leg on the next
//!   calendar day; tau2 writes `2024-05-{day + 1}`, the same day for May 9–30 but no date
//!   (`2024-05-2`, `2024-05-32`) or the wrong month otherwise;
//! - the write log namespace `taubench_airline_undo` (one document per write not undone).

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use crate::common::{Context, FieldIs, Plugin, Store, StoreExt, ToolError, ToolSpec, add_days, record_id};
use crate::docs::Docs;
use crate::json_text::members;
use crate::taubench::{
    self, array_arg, float, int_arg, int_of, item_str, object, python_float, rejected, str_arg, string, undo_schema,
};

pub struct TaubenchAirline;

/// Where each write records what it changed, for its compensator.
pub const UNDO_NAMESPACE: &str = "taubench_airline_undo";

/// tau2's "now": the time stamp of every reservation booked in its airline world.
pub const NOW: &str = "2024-05-15T15:00:00";

/// The write tools and their compensators.
pub const WRITE_TOOLS: [(&str, &str); 6] = [
    ("book_reservation", "undo_book_reservation"),
    ("cancel_reservation", "undo_cancel_reservation"),
    ("update_reservation_flights", "undo_update_reservation_flights"),
    ("update_reservation_passengers", "undo_update_reservation_passengers"),
    ("update_reservation_baggages", "undo_update_reservation_baggages"),
    ("send_certificate", "undo_send_certificate"),
];

const CABINS: [&str; 3] = ["business", "economy", "basic_economy"];

const AIRPORTS: [(&str, &str); 20] = [
    ("SFO", "San Francisco"),
    ("JFK", "New York"),
    ("LAX", "Los Angeles"),
    ("ORD", "Chicago"),
    ("DFW", "Dallas"),
    ("DEN", "Denver"),
    ("SEA", "Seattle"),
    ("ATL", "Atlanta"),
    ("MIA", "Miami"),
    ("BOS", "Boston"),
    ("PHX", "Phoenix"),
    ("IAH", "Houston"),
    ("LAS", "Las Vegas"),
    ("MCO", "Orlando"),
    ("EWR", "Newark"),
    ("CLT", "Charlotte"),
    ("MSP", "Minneapolis"),
    ("DTW", "Detroit"),
    ("PHL", "Philadelphia"),
    ("LGA", "LaGuardia"),
];

fn flight_infos() -> Value {
    json!({
        "type": "array",
        "items": object(json!({ "flight_number": string(), "date": string() }), &["flight_number", "date"])
    })
}

fn passengers() -> Value {
    json!({
        "type": "array",
        "items": object(
            json!({ "first_name": string(), "last_name": string(), "dob": string() }),
            &["first_name", "last_name", "dob"]
        )
    })
}

impl Plugin for TaubenchAirline {
    fn manifest() -> Vec<ToolSpec> {
        let od_date = || {
            object(
                json!({ "origin": string(), "destination": string(), "date": string() }),
                &["origin", "destination", "date"],
            )
        };
        let mut tools = vec![
            ToolSpec::action(
                "book_reservation",
                "Book a reservation for a user: flights in one cabin for a list of passengers, paid \
                 with the user's payment methods (gift card and certificate amounts are checked; a \
                 certificate is used up whole). Returns the reservation.",
                object(
                    json!({
                        "user_id": string(),
                        "origin": string(),
                        "destination": string(),
                        "flight_type": { "enum": ["round_trip", "one_way"] },
                        "cabin": { "enum": CABINS },
                        "flights": flight_infos(),
                        "passengers": passengers(),
                        "payment_methods": {
                            "type": "array",
                            "items": object(
                                json!({ "payment_id": string(), "amount": { "type": "integer" } }),
                                &["payment_id", "amount"]
                            )
                        },
                        "total_baggages": { "type": "integer" },
                        "nonfree_baggages": { "type": "integer" },
                        "insurance": { "enum": ["yes", "no"] }
                    }),
                    &[
                        "user_id",
                        "origin",
                        "destination",
                        "flight_type",
                        "cabin",
                        "flights",
                        "passengers",
                        "payment_methods",
                        "total_baggages",
                        "nonfree_baggages",
                        "insurance",
                    ],
                ),
                "undo_book_reservation",
            ),
            ToolSpec::action(
                "cancel_reservation",
                "Cancel a whole reservation: refunds every payment in its history and marks it \
                 cancelled (its seats are given back). Returns the reservation.",
                object(json!({ "reservation_id": string() }), &["reservation_id"]),
                "undo_cancel_reservation",
            ),
            ToolSpec::action(
                "update_reservation_flights",
                "Replace the flights of a reservation (list every flight of the new itinerary, \
                 changed or not) and its cabin; the price difference is paid with, or refunded to, \
                 a payment method of the user (not a certificate). Returns the reservation.",
                object(
                    json!({
                        "reservation_id": string(),
                        "cabin": { "enum": CABINS },
                        "flights": flight_infos(),
                        "payment_id": string()
                    }),
                    &["reservation_id", "cabin", "flights", "payment_id"],
                ),
                "undo_update_reservation_flights",
            ),
            ToolSpec::action(
                "update_reservation_passengers",
                "Replace the passengers of a reservation (the number of passengers cannot change). \
                 Returns the reservation.",
                object(
                    json!({ "reservation_id": string(), "passengers": passengers() }),
                    &["reservation_id", "passengers"],
                ),
                "undo_update_reservation_passengers",
            ),
            ToolSpec::action(
                "update_reservation_baggages",
                "Set the baggage counts of a reservation; each added non-free bag costs 50, paid \
                 with a payment method of the user (not a certificate). Returns the reservation.",
                object(
                    json!({
                        "reservation_id": string(),
                        "total_baggages": { "type": "integer" },
                        "nonfree_baggages": { "type": "integer" },
                        "payment_id": string()
                    }),
                    &["reservation_id", "total_baggages", "nonfree_baggages", "payment_id"],
                ),
                "undo_update_reservation_baggages",
            ),
            ToolSpec::action(
                "send_certificate",
                "Add a travel certificate of `amount` to a user's payment methods. Be careful!",
                object(json!({ "user_id": string(), "amount": { "type": "number" } }), &["user_id", "amount"]),
                "undo_send_certificate",
            ),
            ToolSpec::query(
                "get_user_details",
                "The details of a user: name, address, payment methods, saved passengers, \
                 membership and reservation ids.",
                object(json!({ "user_id": string() }), &["user_id"]),
            ),
            ToolSpec::query(
                "get_reservation_details",
                "The details of a reservation.",
                object(json!({ "reservation_id": string() }), &["reservation_id"]),
            ),
            ToolSpec::query(
                "search_direct_flight",
                "Direct flights from origin to destination (IATA codes) on a date (YYYY-MM-DD) \
                 that are available for booking, with seats left and prices per cabin.",
                od_date(),
            ),
            ToolSpec::query(
                "search_onestop_flight",
                "Pairs of available flights from origin to destination with one stop, the first \
                 on the date (YYYY-MM-DD), the second leaving the stop after the first arrives.",
                od_date(),
            ),
            ToolSpec::query("list_all_airports", "The airports served: IATA code and city.", object(json!({}), &[])),
            ToolSpec::query(
                "get_flight_status",
                "The status of a flight on a date.",
                object(json!({ "flight_number": string(), "date": string() }), &["flight_number", "date"]),
            ),
        ];
        tools.extend(taubench::shared_queries());
        for (tool, compensator) in WRITE_TOOLS {
            let description = match tool {
                "book_reservation" => {
                    "Undoes a book_reservation: removes the reservation, gives back seats and payments."
                }
                "cancel_reservation" => {
                    "Undoes a cancel_reservation: the reservation as it was, its seats taken again."
                }
                "update_reservation_flights" => {
                    "Undoes an update_reservation_flights: flights, cabin, seats and payment."
                }
                "update_reservation_passengers" => "Undoes an update_reservation_passengers.",
                "update_reservation_baggages" => "Undoes an update_reservation_baggages: counts and payment.",
                _ => "Undoes a send_certificate: removes the certificate.",
            };
            tools.push(ToolSpec::undo(compensator, description, undo_schema()));
        }
        tools
    }

    fn call(store: &mut dyn Store, tool: &str, args: &Value, ctx: &Context) -> Result<Value, ToolError> {
        match tool {
            "book_reservation" => write(store, tool, args, ctx, book_reservation),
            "cancel_reservation" => write(store, tool, args, ctx, cancel_reservation),
            "update_reservation_flights" => write(store, tool, args, ctx, update_reservation_flights),
            "update_reservation_passengers" => write(store, tool, args, ctx, update_reservation_passengers),
            "update_reservation_baggages" => write(store, tool, args, ctx, update_reservation_baggages),
            "send_certificate" => write(store, tool, args, ctx, send_certificate),
            "get_user_details" => get_user_details(store, args),
            "get_reservation_details" => get_reservation_details(store, args),
            "search_direct_flight" => search_direct_flight(store, args),
            "search_onestop_flight" => search_onestop_flight(store, args),
            "list_all_airports" => {
                Ok(AIRPORTS.iter().map(|(iata, city)| json!({ "iata": iata, "city": city })).collect())
            }
            "get_flight_status" => get_flight_status(store, args),
            other => taubench::call_shared(store, other, args, &WRITE_TOOLS, UNDO_NAMESPACE),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Arguments and lookups

/// `(flight_number, date)` of each item of a list of tau2 `FlightInfo`s.
fn flight_info_arg(args: &Value) -> Result<Vec<(String, String)>, ToolError> {
    array_arg(args, "flights")?
        .iter()
        .map(|f| {
            Ok((item_str(f, "flights", "flight_number")?.to_string(), item_str(f, "flights", "date")?.to_string()))
        })
        .collect()
}

/// tau2 `Passenger`s: the three fields it keeps (others are dropped, as pydantic drops them).
fn passengers_arg(args: &Value) -> Result<Vec<Value>, ToolError> {
    array_arg(args, "passengers")?
        .iter()
        .map(|p| {
            Ok(json!({
                "first_name": item_str(p, "passengers", "first_name")?,
                "last_name": item_str(p, "passengers", "last_name")?,
                "dob": item_str(p, "passengers", "dob")?,
            }))
        })
        .collect()
}

fn user_doc(docs: &mut Docs<'_>, user_id: &str) -> Result<Value, ToolError> {
    docs.load("users", user_id)?.ok_or_else(|| rejected(format!("User {user_id} not found")))
}

/// Refuses an unknown user without reading the user's document.
fn require_user(docs: &mut Docs<'_>, user_id: &str) -> Result<(), ToolError> {
    match docs.exists("users", user_id)? {
        true => Ok(()),
        false => Err(rejected(format!("User {user_id} not found"))),
    }
}

fn reservation_doc(docs: &mut Docs<'_>, id: &str) -> Result<Value, ToolError> {
    docs.load("reservations", id)?.ok_or_else(|| rejected(format!("Reservation {id} not found")))
}

/// A flight's record for one date (tau2's `_get_flight_instance`), read without the others.
fn flight_day(docs: &mut Docs<'_>, number: &str, date: &str) -> Result<Value, ToolError> {
    if !docs.exists("flights", number)? {
        return Err(rejected(format!("Flight {number} not found")));
    }
    docs.at("flights", number, &["dates", date])?
        .ok_or_else(|| rejected(format!("Flight {number} not found on date {date}")))
}

/// A cabin's entry of `available_seats` or `prices` (Python's KeyError names the key).
fn cabin_int(day: &Value, field: &str, cabin: &str) -> Result<i64, ToolError> {
    day[field].get(cabin).and_then(int_of).ok_or_else(|| rejected(format!("'{cabin}'")))
}

/// The reservation segment (as tau2 records it) of `count` passengers in `cabin` on flight
/// `number` on `date`, and its price per passenger; refused as tau2 refuses a flight that is
/// not on sale that day or lacks the seats.
fn bookable_segment(
    docs: &mut Docs<'_>,
    number: &str,
    date: &str,
    cabin: &str,
    count: i64,
) -> Result<(Value, i64), ToolError> {
    let day = flight_day(docs, number, date)?;
    if day["status"] != "available" {
        return Err(rejected(format!("Flight {number} not available on date {date}")));
    }
    if cabin_int(&day, "available_seats", cabin)? < count {
        return Err(rejected(format!("Not enough seats on flight {number}")));
    }
    let price = cabin_int(&day, "prices", cabin)?;
    let [origin, destination] = docs.fields("flights", number, ["origin", "destination"])?;
    let segment = json!({
        "flight_number": number,
        "date": date,
        "price": price,
        "origin": origin.unwrap_or_default(),
        "destination": destination.unwrap_or_default(),
    });
    Ok((segment, price))
}

fn passenger_count(reservation: &Value) -> i64 {
    reservation["passengers"].as_array().map_or(0, |p| p.len() as i64)
}

fn is_cancelled(reservation: &Value) -> bool {
    reservation["status"] == "cancelled"
}

/// A reservation as tau2 returns it: `status` is null until it is cancelled.
fn reservation_view(mut reservation: Value) -> Value {
    if let Some(fields) = reservation.as_object_mut() {
        fields.entry("status").or_insert(Value::Null);
    }
    reservation
}

fn seats_path<'a>(date: &'a str, cabin: &'a str) -> [&'a str; 4] {
    ["dates", date, "available_seats", cabin]
}

/// Adds `delta` to the seats left in `cabin` on a flight date, if that date still sells seats.
fn move_seats(docs: &mut Docs<'_>, number: &str, date: &str, cabin: &str, delta: i64) -> Result<(), ToolError> {
    let path = seats_path(date, cabin);
    let Some(seats) = docs.at("flights", number, &path)?.as_ref().and_then(int_of) else { return Ok(()) };
    docs.set("flights", number, &path, Some(json!(seats + delta)))
}

/// A payment method's `amount` (gift cards and certificates), as tau2's float.
fn amount_of(method: &Value) -> f64 {
    method["amount"].as_f64().unwrap_or(0.0)
}

// ---------------------------------------------------------------------------------------------
// Writes

fn write(
    store: &mut dyn Store,
    tool: &str,
    args: &Value,
    ctx: &Context,
    apply: taubench::Apply,
) -> Result<Value, ToolError> {
    taubench::write(store, UNDO_NAMESPACE, tool, args, ctx, apply)
}

fn book_reservation(docs: &mut Docs<'_>, args: &Value, ctx: &Context) -> Result<Value, ToolError> {
    let user_id = str_arg(args, "user_id")?;
    let cabin = str_arg(args, "cabin")?;
    let flights = flight_info_arg(args)?;
    let passengers = passengers_arg(args)?;
    let payments = array_arg(args, "payment_methods")?
        .iter()
        .map(|p| {
            let amount = p.get("amount").and_then(int_of).ok_or_else(|| {
                ToolError::InvalidInput("every item of 'payment_methods' needs an integer 'amount'".into())
            })?;
            Ok((item_str(p, "payment_methods", "payment_id")?.to_string(), amount))
        })
        .collect::<Result<Vec<_>, ToolError>>()?;
    let (total_baggages, nonfree_baggages) = (int_arg(args, "total_baggages")?, int_arg(args, "nonfree_baggages")?);
    let insurance = str_arg(args, "insurance")?;

    let user = user_doc(docs, user_id)?;
    let id = record_id("", &ctx.idempotency_key);
    if docs.load("reservations", &id)?.is_some() {
        return Err(rejected(format!("reservation id {id}, derived from the idempotency key, is taken")));
    }

    let count = passengers.len() as i64;
    let mut segments = Vec::new();
    let mut total_price = 0;
    for (number, date) in &flights {
        let (segment, price) = bookable_segment(docs, number, date, cabin, count)?;
        segments.push(segment);
        total_price += price * count;
    }
    if insurance == "yes" {
        total_price += 30 * count;
    }
    total_price += 50 * nonfree_baggages;

    for (payment_id, amount) in &payments {
        let method = user["payment_methods"]
            .get(payment_id)
            .ok_or_else(|| rejected(format!("Payment method {payment_id} not found")))?;
        if matches!(method["source"].as_str(), Some("gift_card" | "certificate")) && amount_of(method) < *amount as f64
        {
            return Err(rejected(format!("Not enough balance in payment method {payment_id}")));
        }
    }
    let paid: i64 = payments.iter().map(|(_, amount)| amount).sum();
    if paid != total_price {
        return Err(rejected(format!("Payment amount does not add up, total price is {total_price}, but paid {paid}")));
    }

    // Every check passed: pay, take the seats, record the reservation.
    for (payment_id, amount) in &payments {
        let user = user_doc(docs, user_id)?;
        // A certificate listed twice is gone the second time (Python's KeyError).
        let method = user["payment_methods"].get(payment_id).ok_or_else(|| rejected(format!("'{payment_id}'")))?;
        match method["source"].as_str() {
            Some("gift_card") => {
                let left = amount_of(method) - *amount as f64;
                docs.set("users", user_id, &["payment_methods", payment_id, "amount"], Some(float(left)))?;
            }
            Some("certificate") => docs.set("users", user_id, &["payment_methods", payment_id], None)?,
            _ => {}
        }
    }
    for (number, date) in &flights {
        move_seats(docs, number, date, cabin, -count)?;
    }
    let history: Vec<Value> =
        payments.iter().map(|(payment_id, amount)| json!({ "payment_id": payment_id, "amount": amount })).collect();
    let reservation = json!({
        "reservation_id": id,
        "user_id": user_id,
        "origin": str_arg(args, "origin")?,
        "destination": str_arg(args, "destination")?,
        "flight_type": str_arg(args, "flight_type")?,
        "cabin": cabin,
        "flights": segments,
        "passengers": passengers,
        "payment_history": history,
        "created_at": NOW,
        "total_baggages": total_baggages,
        "nonfree_baggages": nonfree_baggages,
        "insurance": insurance,
    });
    docs.create("reservations", &id, reservation.clone())?;
    docs.push("users", user_id, &["reservations"], json!(id))?;
    Ok(reservation_view(reservation))
}

fn cancel_reservation(docs: &mut Docs<'_>, args: &Value, _: &Context) -> Result<Value, ToolError> {
    let id = str_arg(args, "reservation_id")?;
    let reservation = reservation_doc(docs, id)?;
    let history = reservation["payment_history"].as_array().cloned().unwrap_or_default();
    for payment in &history {
        let amount = match int_of(&payment["amount"]) {
            Some(amount) => json!(-amount),
            None => float(-payment["amount"].as_f64().unwrap_or(0.0)),
        };
        docs.push(
            "reservations",
            id,
            &["payment_history"],
            json!({ "payment_id": payment["payment_id"], "amount": amount }),
        )?;
    }
    docs.set("reservations", id, &["status"], Some(json!("cancelled")))?;
    if !is_cancelled(&reservation) {
        // The seats of every passenger go back on sale (tau2 leaves them taken).
        let cabin = reservation["cabin"].as_str().unwrap_or_default();
        let count = passenger_count(&reservation);
        for segment in reservation["flights"].as_array().into_iter().flatten() {
            let (number, date) = (segment["flight_number"].as_str(), segment["date"].as_str());
            move_seats(docs, number.unwrap_or_default(), date.unwrap_or_default(), cabin, count)?;
        }
    }
    Ok(reservation_view(reservation_doc(docs, id)?))
}

/// tau2's `_payment_for_update`: checks the payment method and takes `total_price` from it
/// (a gift card's balance moves, also up when the price is negative); the payment to record,
/// if the price is not zero.
fn payment_for_update(
    docs: &mut Docs<'_>,
    user_id: &str,
    payment_id: &str,
    total_price: i64,
) -> Result<Option<Value>, ToolError> {
    require_user(docs, user_id)?;
    let method = docs.at("users", user_id, &["payment_methods", payment_id])?;
    let method = method.ok_or_else(|| rejected("Payment method not found"))?;
    match method["source"].as_str() {
        Some("certificate") => return Err(rejected("Certificate cannot be used to update reservation")),
        Some("gift_card") => {
            if amount_of(&method) < total_price as f64 {
                return Err(rejected("Gift card balance is not enough"));
            }
            let left = amount_of(&method) - total_price as f64;
            docs.set("users", user_id, &["payment_methods", payment_id, "amount"], Some(float(left)))?;
        }
        _ => {}
    }
    Ok((total_price != 0).then(|| json!({ "payment_id": payment_id, "amount": total_price })))
}

fn update_reservation_flights(docs: &mut Docs<'_>, args: &Value, _: &Context) -> Result<Value, ToolError> {
    let id = str_arg(args, "reservation_id")?;
    let cabin = str_arg(args, "cabin")?;
    let flights = flight_info_arg(args)?;
    let payment_id = str_arg(args, "payment_id")?;
    let reservation = reservation_doc(docs, id)?;
    let user_id = reservation["user_id"].as_str().unwrap_or_default().to_string();
    require_user(docs, &user_id)?;

    let count = passenger_count(&reservation);
    let old_cabin = reservation["cabin"].as_str().unwrap_or_default();
    let old: Vec<Value> = reservation["flights"].as_array().cloned().unwrap_or_default();
    let mut kept = vec![false; old.len()];
    let mut segments = Vec::new();
    let mut added = Vec::new();
    let mut total_price = 0;
    for (number, date) in &flights {
        // A flight the reservation has, in an unchanged cabin, is kept at the price paid.
        let same = old.iter().position(|s| s["flight_number"] == number.as_str() && s["date"] == date.as_str());
        if let Some(index) = same.filter(|_| cabin == old_cabin) {
            kept[index] = true;
            total_price += int_of(&old[index]["price"]).unwrap_or(0) * count;
            segments.push(old[index].clone());
            continue;
        }
        let (segment, price) = bookable_segment(docs, number, date, cabin, count)?;
        segments.push(segment);
        added.push((number, date));
        total_price += price * count;
    }
    total_price -= old.iter().map(|s| int_of(&s["price"]).unwrap_or(0)).sum::<i64>() * count;

    if let Some(payment) = payment_for_update(docs, &user_id, payment_id, total_price)? {
        docs.push("reservations", id, &["payment_history"], payment)?;
    }
    docs.set("reservations", id, &["flights"], Some(Value::Array(segments)))?;
    docs.set("reservations", id, &["cabin"], Some(json!(cabin)))?;
    if !is_cancelled(&reservation) {
        // Seats follow the itinerary (tau2 leaves the flights untouched).
        for (segment, _) in old.iter().zip(&kept).filter(|(_, kept)| !**kept) {
            let (number, date) = (segment["flight_number"].as_str(), segment["date"].as_str());
            move_seats(docs, number.unwrap_or_default(), date.unwrap_or_default(), old_cabin, count)?;
        }
        for (number, date) in added {
            move_seats(docs, number, date, cabin, -count)?;
        }
    }
    Ok(reservation_view(reservation_doc(docs, id)?))
}

fn update_reservation_passengers(docs: &mut Docs<'_>, args: &Value, _: &Context) -> Result<Value, ToolError> {
    let id = str_arg(args, "reservation_id")?;
    let passengers = passengers_arg(args)?;
    let reservation = reservation_doc(docs, id)?;
    if passengers.len() as i64 != passenger_count(&reservation) {
        return Err(rejected("Number of passengers does not match"));
    }
    docs.set("reservations", id, &["passengers"], Some(Value::Array(passengers)))?;
    Ok(reservation_view(reservation_doc(docs, id)?))
}

fn update_reservation_baggages(docs: &mut Docs<'_>, args: &Value, _: &Context) -> Result<Value, ToolError> {
    let id = str_arg(args, "reservation_id")?;
    let (total_baggages, nonfree_baggages) = (int_arg(args, "total_baggages")?, int_arg(args, "nonfree_baggages")?);
    let payment_id = str_arg(args, "payment_id")?;
    let reservation = reservation_doc(docs, id)?;
    let user_id = reservation["user_id"].as_str().unwrap_or_default().to_string();
    require_user(docs, &user_id)?;
    let paid_for = int_of(&reservation["nonfree_baggages"]).unwrap_or(0);
    let total_price = 50 * (nonfree_baggages - paid_for).max(0);
    if let Some(payment) = payment_for_update(docs, &user_id, payment_id, total_price)? {
        docs.push("reservations", id, &["payment_history"], payment)?;
    }
    docs.set("reservations", id, &["total_baggages"], Some(json!(total_baggages)))?;
    docs.set("reservations", id, &["nonfree_baggages"], Some(json!(nonfree_baggages)))?;
    Ok(reservation_view(reservation_doc(docs, id)?))
}

fn send_certificate(docs: &mut Docs<'_>, args: &Value, ctx: &Context) -> Result<Value, ToolError> {
    let user_id = str_arg(args, "user_id")?;
    let amount = args.get("amount").filter(|a| a.is_number()).cloned();
    let amount = amount.ok_or_else(|| ToolError::InvalidInput("'amount' must be a number".into()))?;
    let user = user_doc(docs, user_id)?;
    let id = record_id("certificate_", &ctx.idempotency_key);
    if user["payment_methods"].get(&id).is_some() {
        return Err(rejected(format!("certificate id {id}, derived from the idempotency key, is taken")));
    }
    let certificate = json!({ "id": id, "amount": amount, "source": "certificate" });
    docs.set("users", user_id, &["payment_methods", &id], Some(certificate))?;
    let shown = match amount.as_i64() {
        Some(whole) if amount.is_i64() || amount.is_u64() => whole.to_string(),
        _ => python_float(amount.as_f64().unwrap_or(0.0)),
    };
    Ok(json!(format!("Certificate {id} added to user {user_id} with amount {shown}.")))
}

// ---------------------------------------------------------------------------------------------
// Reads

fn get_user_details(store: &mut dyn Store, args: &Value) -> Result<Value, ToolError> {
    let user_id = str_arg(args, "user_id")?;
    store.doc("users", user_id)?.ok_or_else(|| rejected(format!("User {user_id} not found")))
}

fn get_reservation_details(store: &mut dyn Store, args: &Value) -> Result<Value, ToolError> {
    let id = str_arg(args, "reservation_id")?;
    store.doc("reservations", id)?.map(reservation_view).ok_or_else(|| rejected(format!("Reservation {id} not found")))
}

fn get_flight_status(store: &mut dyn Store, args: &Value) -> Result<Value, ToolError> {
    let (number, date) = (str_arg(args, "flight_number")?, str_arg(args, "date")?);
    Ok(flight_day(&mut Docs::new(store, false), number, date)?["status"].clone())
}

/// What a search needs of a flight: its fields, and its records for the dates searched.
struct Flight {
    number: Value,
    origin: String,
    destination: String,
    departure: String,
    arrival: String,
    /// The records of the searched dates it has.
    days: Vec<(String, Value)>,
}

impl Flight {
    fn day(&self, date: &str) -> Option<&Value> {
        self.days.iter().find(|(d, _)| d == date).map(|(_, day)| day)
    }

    /// From a flight document's text, parsing only the top-level fields and the records of
    /// `dates` (a flight carries a month of dates; parsing them all is most of a search's cost).
    fn read(text: &str, dates: &[&str]) -> Result<Flight, String> {
        let text_of = |v: &Value, field: &str| v[field].as_str().unwrap_or_default().to_string();
        let Some(fields) = members(text) else {
            // Not an object this scanner reads (it has escaped keys): parse it all.
            let flight: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
            return Ok(Flight {
                number: flight["flight_number"].clone(),
                origin: text_of(&flight, "origin"),
                destination: text_of(&flight, "destination"),
                departure: text_of(&flight, "scheduled_departure_time_est"),
                arrival: text_of(&flight, "scheduled_arrival_time_est"),
                days: dates.iter().filter_map(|d| Some((d.to_string(), flight["dates"].get(*d)?.clone()))).collect(),
            });
        };
        let mut top = Map::new();
        let mut days = Vec::new();
        for (key, value) in fields {
            match key {
                "dates" => {
                    let all = members(value).ok_or("its dates are not an object")?;
                    for (date, day) in all.into_iter().filter(|(date, _)| dates.contains(date)) {
                        days.push((date.to_string(), serde_json::from_str(day).map_err(|e| e.to_string())?));
                    }
                }
                "flight_number"
                | "origin"
                | "destination"
                | "scheduled_departure_time_est"
                | "scheduled_arrival_time_est" => {
                    top.insert(key.to_string(), serde_json::from_str(value).map_err(|e| e.to_string())?);
                }
                _ => {}
            }
        }
        let top = Value::Object(top);
        Ok(Flight {
            number: top["flight_number"].clone(),
            origin: text_of(&top, "origin"),
            destination: text_of(&top, "destination"),
            departure: text_of(&top, "scheduled_departure_time_est"),
            arrival: text_of(&top, "scheduled_arrival_time_est"),
            days,
        })
    }
}

/// The flights whose `field` is `value`, read for `dates`, in flight-number order (tau2's).
/// The store filters: only the matching flights cross into the plugin.
fn flights_where(store: &mut dyn Store, field: &str, value: &str, dates: &[&str]) -> Result<Vec<Flight>, ToolError> {
    read_flights(store.find("flights", "", &[FieldIs::string(&[field], value)])?, dates)
}

fn read_flights(found: Vec<(String, String)>, dates: &[&str]) -> Result<Vec<Flight>, ToolError> {
    found
        .iter()
        .map(|(number, text)| {
            Flight::read(text, dates)
                .map_err(|e| ToolError::Transient(format!("flights/{number} is not a flight: {e}")))
        })
        .collect()
}

/// tau2's `_search_direct_flight` over scanned flights.
fn direct<'f>(
    flights: impl IntoIterator<Item = &'f Flight>,
    date: &str,
    origin: Option<&str>,
    destination: Option<&str>,
    leave_after: Option<&str>,
) -> Vec<(&'f Flight, &'f Value)> {
    flights
        .into_iter()
        .filter(|f| origin.is_none_or(|o| f.origin == o) && destination.is_none_or(|d| f.destination == d))
        .filter(|f| leave_after.is_none_or(|after| f.departure.as_str() >= after))
        .filter_map(|f| f.day(date).filter(|day| day["status"] == "available").map(|day| (f, day)))
        .collect()
}

/// A flight as tau2's `DirectFlight`.
fn direct_flight(flight: &Flight, day: &Value, date: Option<&str>) -> Value {
    json!({
        "flight_number": flight.number,
        "origin": flight.origin,
        "destination": flight.destination,
        "status": "available",
        "scheduled_departure_time_est": flight.departure,
        "scheduled_arrival_time_est": flight.arrival,
        "date": date,
        "available_seats": day["available_seats"],
        "prices": day["prices"],
    })
}

fn search_direct_flight(store: &mut dyn Store, args: &Value) -> Result<Value, ToolError> {
    let (origin, destination, date) = (str_arg(args, "origin")?, str_arg(args, "destination")?, str_arg(args, "date")?);
    let route = [FieldIs::string(&["origin"], origin), FieldIs::string(&["destination"], destination)];
    let flights = read_flights(store.find("flights", "", &route)?, &[date])?;
    let found = direct(&flights, date, Some(origin), Some(destination), None);
    Ok(found.into_iter().map(|(flight, day)| direct_flight(flight, day, None)).collect())
}

fn search_onestop_flight(store: &mut dyn Store, args: &Value) -> Result<Value, ToolError> {
    let (origin, destination, date) = (str_arg(args, "origin")?, str_arg(args, "destination")?, str_arg(args, "date")?);
    // One pass: the first legs leave from `origin`, the second legs arrive at `destination`,
    // on the date or (after an overnight first leg) the next day.
    let next_day = add_days(date, 1);
    let dates: Vec<&str> = [Some(date), next_day.as_deref()].into_iter().flatten().collect();
    let (firsts, seconds) =
        (flights_where(store, "origin", origin, &dates)?, flights_where(store, "destination", destination, &dates)?);
    let mut from_stop: BTreeMap<&str, Vec<&Flight>> = BTreeMap::new();
    for flight in &seconds {
        from_stop.entry(flight.origin.as_str()).or_default().push(flight);
    }
    let mut pairs = Vec::new();
    for (first, first_day) in direct(&firsts, date, Some(origin), None, None) {
        let second_date = if first.arrival.contains("+1") { next_day.as_deref() } else { Some(date) };
        let (Some(second_date), Some(seconds)) = (second_date, from_stop.get(first.destination.as_str())) else {
            continue;
        };
        let leg = direct_flight(first, first_day, Some(date));
        for (second, second_day) in direct(seconds.iter().copied(), second_date, None, None, Some(&first.arrival)) {
            pairs.push(json!([leg, direct_flight(second, second_day, Some(second_date))]));
        }
    }
    Ok(Value::Array(pairs))
}
