//! A seeded generator of large fixtures in the shapes the bundled tools use (tau-bench's
//! airline and retail databases, plus hotels, rental offices, pools, agents and carriers),
//! for exercising snapshot and verification cost on big stores.

use rand::{Rng, SeedableRng, seq::IndexedRandom};
use rand_chacha::ChaCha8Rng;
use serde_json::{Map, Value, json};

const AIRPORTS: [&str; 12] = ["SFO", "JFK", "LAX", "ORD", "ATL", "SEA", "BOS", "DEN", "MIA", "PHX", "IAH", "EWR"];
const CITIES: [&str; 6] = ["New York", "San Francisco", "Chicago", "Seattle", "Boston", "Denver"];
const FIRST: [&str; 8] = ["Mia", "Yusuf", "Ada", "Chen", "Dara", "Jo", "Noah", "Ivan"];
const LAST: [&str; 8] = ["Li", "Rossi", "Lovelace", "Wang", "Okafor", "Park", "Smith", "Petrov"];
const PRODUCTS: [&str; 6] = ["Water Bottle", "Laptop", "Desk Lamp", "Backpack", "Headphones", "Keyboard"];

/// How many of each record one unit of `scale` makes (1 unit ≈ 0.35 MB of canonical JSON).
pub struct Scale {
    pub flights: usize,
    pub dates_per_flight: usize,
    pub users: usize,
    pub reservations: usize,
    pub products: usize,
    pub orders: usize,
    pub hotels: usize,
}

impl Scale {
    pub fn of(units: usize) -> Scale {
        Scale {
            flights: 100 * units,
            dates_per_flight: 10,
            users: 50 * units,
            reservations: 100 * units,
            products: 20 * units,
            orders: 100 * units,
            hotels: 10 * units,
        }
    }
}

fn pick(rng: &mut ChaCha8Rng, choices: &[&'static str]) -> &'static str {
    choices.choose(rng).copied().unwrap_or_default()
}

fn date(day: usize) -> String {
    add_days_2024(day)
}

/// 2024-05-01 plus `day` days (within 2024).
fn add_days_2024(day: usize) -> String {
    const MONTHS: [usize; 12] = [31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
    let mut remaining = 121 + day; // 2024-05-01 is day 121 of the leap year 2024, counting from 0
    for (m, len) in MONTHS.iter().enumerate() {
        if remaining < *len {
            return format!("2024-{:02}-{:02}", m + 1, remaining + 1);
        }
        remaining -= len;
    }
    "2024-12-31".to_string()
}

/// A store of `scale` units from `seed`, as `{namespace: {key: document}}`.
pub fn generate(seed: u64, scale: &Scale) -> Value {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut store = Map::new();

    let mut flights = Map::new();
    for n in 0..scale.flights {
        let number = format!("HAT{n:04}");
        let origin = *AIRPORTS.choose(&mut rng).unwrap_or(&"SFO");
        let destination =
            *AIRPORTS.iter().filter(|a| **a != origin).collect::<Vec<_>>().choose(&mut rng).map_or(&"JFK", |v| v);
        let depart = rng.random_range(5..20);
        let mut dates = Map::new();
        for d in 0..scale.dates_per_flight {
            let base = rng.random_range(80..400);
            dates.insert(
                date(d),
                json!({
                    "status": "available",
                    "available_seats": {
                        "basic_economy": rng.random_range(0..20),
                        "economy": rng.random_range(0..30),
                        "business": rng.random_range(0..10)
                    },
                    "prices": { "basic_economy": base, "economy": base * 2, "business": base * 5 }
                }),
            );
        }
        flights.insert(
            number.clone(),
            json!({
                "flight_number": number,
                "origin": origin,
                "destination": destination,
                "scheduled_departure_time_est": format!("{depart:02}:00:00"),
                "scheduled_arrival_time_est": format!("{:02}:30:00", (depart + rng.random_range(1..6)) % 24),
                "dates": dates
            }),
        );
    }

    let mut users = Map::new();
    let mut user_ids = Vec::new();
    for n in 0..scale.users {
        let (first, last) = (*FIRST.choose(&mut rng).unwrap_or(&"Jo"), *LAST.choose(&mut rng).unwrap_or(&"Park"));
        let id = format!("{}_{}_{n:04}", first.to_lowercase(), last.to_lowercase());
        let card = format!("credit_card_{}", 1_000_000 + n);
        let gift = format!("gift_card_{}", 2_000_000 + n);
        users.insert(
            id.clone(),
            json!({
                "user_id": id,
                "name": { "first_name": first, "last_name": last },
                "email": format!("{}.{}{n}@example.com", first.to_lowercase(), last.to_lowercase()),
                "address": { "address1": format!("{} Main St", rng.random_range(1..999)), "city": CITIES.choose(&mut rng), "country": "USA" },
                "payment_methods": {
                    card.clone(): { "source": "credit_card", "brand": "visa", "last_four": format!("{:04}", n % 10_000), "id": card, "available_credit": rng.random_range(500..20_000) },
                    gift.clone(): { "source": "gift_card", "amount": rng.random_range(0..500), "id": gift }
                },
                "membership": pick(&mut rng, &["regular", "silver", "gold"]),
                "reservations": [],
                "orders": []
            }),
        );
        user_ids.push(id);
    }

    let mut reservations = Map::new();
    for n in 0..scale.reservations {
        let id = format!("{:06X}", 0x100000 + n);
        let flight = format!("HAT{:04}", rng.random_range(0..scale.flights.max(1)));
        let user = user_ids.choose(&mut rng).cloned().unwrap_or_default();
        reservations.insert(
            id.clone(),
            json!({
                "reservation_id": id,
                "user_id": user,
                "flight_type": "one_way",
                "cabin": pick(&mut rng, &["basic_economy", "economy", "business"]),
                "flights": [{ "flight_number": flight, "date": date(rng.random_range(0..scale.dates_per_flight)), "price": rng.random_range(80..900) }],
                "passengers": [{ "first_name": FIRST.choose(&mut rng), "last_name": LAST.choose(&mut rng), "dob": "1990-01-01" }],
                "payment_history": [],
                "created_at": "2024-04-01T10:00:00",
                "total_baggages": rng.random_range(0..3),
                "nonfree_baggages": 0,
                "insurance": "no",
                "status": "confirmed"
            }),
        );
    }

    let mut products = Map::new();
    let mut items = Vec::new();
    for n in 0..scale.products {
        let id = format!("{}", 8_000_000_000u64 + n as u64);
        let mut variants = Map::new();
        for v in 0..5 {
            let item = format!("{}", 1_000_000_000u64 + (n * 5 + v) as u64);
            variants.insert(
                item.clone(),
                json!({
                    "item_id": item,
                    "options": { "color": pick(&mut rng, &["red", "black", "blue"]), "size": pick(&mut rng, &["S", "M", "L"]) },
                    "available": true,
                    "price": rng.random_range(1_000..300_000) as f64 / 100.0,
                    "stock": rng.random_range(0..50)
                }),
            );
            items.push((id.clone(), item));
        }
        products
            .insert(id.clone(), json!({ "name": PRODUCTS.choose(&mut rng), "product_id": id, "variants": variants }));
    }

    let mut orders = Map::new();
    for n in 0..scale.orders {
        let id = format!("#W{}", 3_000_000 + n);
        let (product, item) = items.choose(&mut rng).cloned().unwrap_or_default();
        orders.insert(
            id.clone(),
            json!({
                "order_id": id,
                "user_id": user_ids.choose(&mut rng),
                "items": [{ "product_id": product, "item_id": item, "quantity": rng.random_range(1..4), "price": rng.random_range(1_000..30_000) as f64 / 100.0 }],
                "status": pick(&mut rng, &["pending", "processed", "delivered"]),
                "fulfillments": [],
                "payment_history": []
            }),
        );
    }

    let mut hotels = Map::new();
    for n in 0..scale.hotels {
        let id = format!("HOTEL-{n:04}");
        let city = *CITIES.choose(&mut rng).unwrap_or(&"Boston");
        let dates: Map<String, Value> = (0..30)
            .map(|d| {
                (date(d), json!({ "rooms_available": rng.random_range(0..20), "price": rng.random_range(90..500) }))
            })
            .collect();
        hotels.insert(
            id.clone(),
            json!({ "hotel_id": id, "name": format!("Hotel {n}"), "address": format!("{n} Park Ave, {city}"), "city": city, "dates": dates }),
        );
    }

    store.insert("flights".into(), Value::Object(flights));
    store.insert("users".into(), Value::Object(users));
    store.insert("reservations".into(), Value::Object(reservations));
    store.insert("products".into(), Value::Object(products));
    store.insert("orders".into(), Value::Object(orders));
    store.insert("hotels".into(), Value::Object(hotels));
    Value::Object(store)
}

/// Lays the documents of `base` over `generated` (a saga's own fixture stays as it is). Both
/// are `{namespace: {key: document}}`; a fixture file or directory gives it as
/// `fixture::load(path)?.to_json()`, so `base` is checked as every fixture is.
pub fn overlay(mut generated: Value, base: &Value) -> Value {
    if let (Some(into), Some(from)) = (generated.as_object_mut(), base.as_object()) {
        for (ns, docs) in from {
            let target = into.entry(ns.clone()).or_insert_with(|| Value::Object(Map::new()));
            if let (Some(target), Some(docs)) = (target.as_object_mut(), docs.as_object()) {
                for (key, doc) in docs {
                    target.insert(key.clone(), doc.clone());
                }
            }
        }
    }
    generated
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_store_and_another_seed_another() {
        let a = crate::json::canonical(&generate(1, &Scale::of(1)));
        assert_eq!(a, crate::json::canonical(&generate(1, &Scale::of(1))));
        assert_ne!(a, crate::json::canonical(&generate(2, &Scale::of(1))));
        let state = crate::store::State::from_json(&generate(1, &Scale::of(1))).unwrap();
        assert_eq!(state.namespace("flights").unwrap().len(), 100);
        assert_eq!(state.namespace("orders").unwrap().len(), 100);
    }

    #[test]
    fn dates_walk_through_months() {
        assert_eq!(add_days_2024(0), "2024-05-01");
        assert_eq!(add_days_2024(31), "2024-06-01");
    }

    #[test]
    fn overlay_keeps_the_base_documents() {
        let merged =
            overlay(json!({ "flights": { "A": 1, "B": 2 } }), &json!({ "flights": { "B": 3 }, "pools": { "p": 4 } }));
        assert_eq!(merged, json!({ "flights": { "A": 1, "B": 3 }, "pools": { "p": 4 } }));
    }
}
