//! Run ids and idempotency keys.

use serde_json::Value;
use sha2::{Digest, Sha256};

/// The idempotency key of a call: lower-case hex SHA-256 over the run id, the step id, the
/// tool and the canonical arguments, each length-prefixed so that no two different calls
/// can produce the same input to the hash.
pub fn idempotency_key(run_id: &str, step_id: &str, tool: &str, args: &Value) -> String {
    idempotency_key_of_text(run_id, step_id, tool, &crate::json::canonical(args))
}

/// [`idempotency_key`] from the arguments' canonical text (`json::canonical`), for a caller
/// that has it already.
pub fn idempotency_key_of_text(run_id: &str, step_id: &str, tool: &str, canonical_args: &str) -> String {
    let mut hasher = Sha256::new();
    for part in [run_id, step_id, tool, canonical_args] {
        hasher.update((part.len() as u64).to_le_bytes());
        hasher.update(part.as_bytes());
    }
    crate::json::lower_hex(&hasher.finalize())
}

/// Where the result of the call with idempotency key `key` is cached. A key derived from its
/// run is cached under the run (`<run id>/<key>`): run ids sort by time, so the cache's index
/// takes a transaction's results together at its end, not each on a page of its own (a
/// quarter fewer pages written per durable saga, BENCHMARKS item 44). A key a client named
/// is cached as it is: a retry with it may come in another run. The key the plugin sees is
/// `key` either way.
pub fn cache_key(run_id: &str, key: &str, client_named: bool) -> String {
    match client_named {
        true => key.to_string(),
        false => format!("{run_id}/{key}"),
    }
}

/// Unix milliseconds now: what a fresh run id begins with, and the clock of run records'
/// times and leases.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// A fresh run id: the milliseconds since the Unix epoch in 12 hex digits, then 16 random
/// ones. Ids made later sort later, so the database's indexes by run id (the journal's, the
/// run registry's) take each new run at their end, where the runs of one transaction share
/// pages, not each on a page of its own: a fifth fewer pages written per durable saga
/// (BENCHMARKS item 43). The random part keeps ids unguessable, and apart within a
/// millisecond.
pub fn new_run_id() -> String {
    format!("{:012x}{:016x}", now_ms(), rand::random::<u64>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Ids made later sort later (the database's indexes by run id take new runs at their
    /// end), and ids made within one millisecond still differ.
    #[test]
    fn run_ids_made_later_sort_later_and_never_repeat() {
        let mut ids = Vec::new();
        for _ in 0..20 {
            ids.push(new_run_id());
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        assert!(ids.windows(2).all(|pair| pair[0] < pair[1]), "not in the order they were made: {ids:?}");
        let burst: std::collections::HashSet<String> = (0..1000).map(|_| new_run_id()).collect();
        assert_eq!(burst.len(), 1000, "ids made at once repeated");
        assert!(burst.iter().all(|id| id.len() == 28 && id.bytes().all(|b| b.is_ascii_hexdigit())), "{burst:?}");
    }

    #[test]
    fn keys_depend_on_every_part_and_not_on_key_order() {
        let k = idempotency_key("run", "flight", "airline.book", &json!({"a": 1, "b": 2}));
        assert_eq!(k, idempotency_key("run", "flight", "airline.book", &json!({"b": 2, "a": 1})));
        assert_ne!(k, idempotency_key("run2", "flight", "airline.book", &json!({"a": 1, "b": 2})));
        assert_ne!(k, idempotency_key("run", "hotel", "airline.book", &json!({"a": 1, "b": 2})));
        assert_ne!(k, idempotency_key("run", "flight", "airline.cancel", &json!({"a": 1, "b": 2})));
        assert_ne!(k, idempotency_key("run", "flight", "airline.book", &json!({"a": 1})));
        // Length prefixes: moving a character between parts changes the key.
        assert_ne!(idempotency_key("ab", "c", "t", &json!(1)), idempotency_key("a", "bc", "t", &json!(1)));
        assert_eq!(k.len(), 64);
    }

    /// Journals written by earlier versions name their calls by these keys: a resumed run
    /// finds its recorded results only if the key of the same call stays the same.
    #[test]
    fn a_key_is_the_documented_hash_of_its_parts() {
        assert_eq!(
            idempotency_key("run", "flight", "airline.book", &json!({"b": 2, "a": 1})),
            "0329a3e5c8a8178c4f154dd6177b28ab026e433d01e06b1224959556cf95a5ac"
        );
        // The engine's way: the canonical text it also hands the guest.
        assert_eq!(
            idempotency_key_of_text("run", "flight", "airline.book", r#"{"a":1,"b":2}"#),
            "0329a3e5c8a8178c4f154dd6177b28ab026e433d01e06b1224959556cf95a5ac"
        );
    }
}
