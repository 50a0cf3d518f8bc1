//! Digests and diffs of store states.
//!
//! A namespace's digest is the SHA-256 of its documents in key order, each contributing
//! `len(key) as u64 LE ‖ key ‖ SHA-256(canonical document)`; the overall digest is the
//! SHA-256 of the namespaces in name order, each contributing `len(name) as u64 LE ‖ name ‖
//! namespace digest`. Per-document hashes are kept with the documents and namespace digests
//! are cached until the namespace changes, so digesting a state after a saga costs only the
//! namespaces the saga touched. Empty namespaces do not exist: deleting the last document of
//! a namespace removes it, so a state restored by compensation digests like the original.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::{Namespace, State};

/// Hex digests of a state: overall and per namespace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Digests {
    pub overall: String,
    pub namespaces: BTreeMap<String, String>,
}

fn length_prefixed(hasher: &mut Sha256, name: &str) {
    hasher.update((name.len() as u64).to_le_bytes());
    hasher.update(name.as_bytes());
}

impl Namespace {
    /// This namespace's digest (cached).
    pub fn digest(&self) -> [u8; 32] {
        *self.digest.get_or_init(|| {
            let mut hasher = Sha256::new();
            for (key, doc) in self.docs.iter() {
                length_prefixed(&mut hasher, key);
                hasher.update(doc.hash);
            }
            hasher.finalize().into()
        })
    }
}

impl State {
    /// The overall digest, hex.
    pub fn digest(&self) -> String {
        self.digest_excluding(&[])
    }

    /// The overall digest of every namespace but `excluded` (ledgers), hex.
    pub fn digest_excluding(&self, excluded: &[String]) -> String {
        let mut hasher = Sha256::new();
        for (ns, namespace) in self.namespaces() {
            if !excluded.contains(ns) {
                length_prefixed(&mut hasher, ns);
                hasher.update(namespace.digest());
            }
        }
        hex::encode(hasher.finalize())
    }

    /// Overall and per-namespace digests.
    pub fn digests(&self) -> Digests {
        Digests {
            overall: self.digest(),
            namespaces: self.namespaces().map(|(ns, n)| (ns.clone(), hex::encode(n.digest()))).collect(),
        }
    }
}

/// How one document differs between two states.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct DiffEntry {
    pub namespace: String,
    pub key: String,
    /// `added`, `removed` or `changed` (verify also reports `unexpected` residue).
    pub change: std::borrow::Cow<'static, str>,
    /// JSON pointers of the fields that differ (for `changed`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fields: Vec<String>,
    pub before: Option<Value>,
    pub after: Option<Value>,
}

/// Every document that differs between two states, in namespace and key order.
pub type Diff = Vec<DiffEntry>;

/// The documents that differ from `before` to `after`, skipping namespaces in `excluded`.
pub fn diff(before: &State, after: &State, excluded: &[String]) -> Diff {
    let parse = |text: &str| serde_json::from_str::<Value>(text).unwrap_or(Value::Null);
    let mut names: Vec<&String> = before.namespaces().map(|(n, _)| n).collect();
    names.extend(after.namespaces().map(|(n, _)| n));
    names.sort();
    names.dedup();
    let empty = Namespace::default();
    let mut entries = Vec::new();
    for ns in names.into_iter().filter(|ns| !excluded.contains(ns)) {
        let (old, new) = (before.namespace(ns).unwrap_or(&empty), after.namespace(ns).unwrap_or(&empty));
        if old.digest() == new.digest() {
            continue;
        }
        let mut keys: Vec<&String> = old.iter().map(|(k, _)| k).chain(new.iter().map(|(k, _)| k)).collect();
        keys.sort();
        keys.dedup();
        for key in keys {
            let (a, b) = (old.get(key), new.get(key));
            let change = match (a, b) {
                (Some(a), Some(b)) if a.hash == b.hash => continue,
                (Some(_), Some(_)) => "changed",
                (Some(_), None) => "removed",
                (None, _) => "added",
            };
            let before = a.map(|d| parse(&d.text));
            let after = b.map(|d| parse(&d.text));
            let mut fields = Vec::new();
            if let (Some(x), Some(y)) = (&before, &after) {
                changed_fields(x, y, String::new(), &mut fields);
            }
            entries.push(DiffEntry {
                namespace: ns.clone(),
                key: key.clone(),
                change: change.into(),
                fields,
                before,
                after,
            });
        }
    }
    entries
}

/// JSON pointers of the leaves (or type changes) where `a` and `b` differ.
fn changed_fields(a: &Value, b: &Value, at: String, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                let path = format!("{at}/{}", k.replace('~', "~0").replace('/', "~1"));
                match (x.get(k), y.get(k)) {
                    (Some(p), Some(q)) => changed_fields(p, q, path, out),
                    _ => out.push(path),
                }
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                changed_fields(p, q, format!("{at}/{i}"), out);
            }
        }
        _ if a != b => out.push(if at.is_empty() { "/".to_string() } else { at }),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::super::{MemoryStore, Txn, WriteQuota};
    use super::*;
    use serde_json::json;

    fn state() -> State {
        State::from_json(&json!({
            "flights": { "HAT001": { "dates": { "2024-05-16": { "seats": 3 } } } },
            "users": { "u1": { "name": "Ada" } }
        }))
        .unwrap()
    }

    #[test]
    fn digest_ignores_order_of_construction_and_layout() {
        let a = state();
        let b = State::from_json(&json!({
            "users": { "u1": { "name": "Ada" } },
            "flights": { "HAT001": { "dates": { "2024-05-16": { "seats": 3.0 } } } }
        }))
        .unwrap();
        assert_eq!(a.digests(), b.digests());
    }

    #[test]
    fn creating_and_removing_a_namespace_restores_the_digest() {
        let store = MemoryStore::new(state());
        let initial = store.snapshot();
        let mut add = Txn::new(store.snapshot(), WriteQuota::default());
        add.put("reservations", "R1", "{}").unwrap();
        store.commit(&add).unwrap();
        assert_ne!(store.snapshot().digest(), initial.digest());
        let mut remove = Txn::new(store.snapshot(), WriteQuota::default());
        remove.delete("reservations", "R1").unwrap();
        store.commit(&remove).unwrap();
        assert_eq!(store.snapshot().digest(), initial.digest());
        assert!(store.snapshot().namespace("reservations").is_none());
    }

    #[test]
    fn diff_names_namespace_key_and_field() {
        let store = MemoryStore::new(state());
        let initial = store.snapshot();
        let mut txn = Txn::new(store.snapshot(), WriteQuota::default());
        txn.put("flights", "HAT001", r#"{"dates":{"2024-05-16":{"seats":2}}}"#).unwrap();
        txn.put("reservations", "R1", r#"{"cabin":"economy"}"#).unwrap();
        store.commit(&txn).unwrap();
        let d = diff(&initial, &store.snapshot(), &[]);
        assert_eq!(d.len(), 2);
        assert_eq!((d[0].namespace.as_str(), d[0].key.as_str(), &*d[0].change), ("flights", "HAT001", "changed"));
        assert_eq!(d[0].fields, ["/dates/2024-05-16/seats"]);
        assert_eq!((d[1].namespace.as_str(), &*d[1].change), ("reservations", "added"));
        assert!(diff(&initial, &store.snapshot(), &["flights".into(), "reservations".into()]).is_empty());
        assert_ne!(store.snapshot().digest_excluding(&["users".into()]), initial.digest_excluding(&["users".into()]));
    }
}
