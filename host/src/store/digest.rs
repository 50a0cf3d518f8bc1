//! Digests and diffs of store states.
//!
//! A namespace's documents fall into [`BUCKETS`] buckets by a hash of their key (FNV-1a's
//! low byte). A bucket's digest is the SHA-256 of its documents in key order, each
//! contributing `len(key) as u64 LE ‖ key ‖ SHA-256(canonical document)`; a namespace's
//! digest is the SHA-256 of its non-empty buckets in bucket order, each contributing
//! `bucket number as u8 ‖ bucket digest`; the overall digest is the SHA-256 of the
//! namespaces in name order, each contributing `len(name) as u64 LE ‖ name ‖ namespace
//! digest`.
//!
//! Per-document hashes are kept with the documents; the first digest of a namespace indexes
//! its buckets, and from then on every write updates that index and forgets only its own
//! bucket's digest. A state derived from a digested one (a verification case's, from the
//! fixture's) therefore digests in O(buckets + the documents of the buckets it touched)
//! instead of O(its size). Empty namespaces do not exist: deleting the last document of a
//! namespace removes it, so a state restored by compensation digests like the original.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use imbl::OrdMap;
use imbl::ordmap::DiffItem;

use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::{Doc, Namespace, State};

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

/// Buckets per namespace: a namespace's digest hashes one digest per non-empty bucket, and a
/// write re-hashes only its bucket's documents (about size/256 of them).
pub const BUCKETS: usize = 256;
const _: () = assert!(BUCKETS <= 256, "the digest format writes a bucket's number as one byte");

/// The bucket of a document's key: FNV-1a's low byte (stable, cheap, and needing no
/// collision resistance: a plugin that crowds one bucket only makes its digest slower).
fn bucket_of(key: &str) -> u8 {
    let mut hash: u32 = 0x811c_9dc5;
    for byte in key.bytes() {
        hash = (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193);
    }
    (hash % BUCKETS as u32) as u8
}

/// One bucket: its documents' hashes by key, and its digest, computed on first use.
#[derive(Clone, Debug, Default)]
pub(super) struct Bucket {
    docs: OrdMap<Arc<str>, [u8; 32]>,
    digest: OnceLock<[u8; 32]>,
}

impl Bucket {
    fn digest(&self) -> [u8; 32] {
        *self.digest.get_or_init(|| {
            let mut hasher = Sha256::new();
            for (key, hash) in self.docs.iter() {
                length_prefixed(&mut hasher, key);
                hasher.update(hash);
            }
            hasher.finalize().into()
        })
    }
}

/// A namespace's non-empty buckets by number (a persistent map: copies share it).
pub(super) type Buckets = OrdMap<u8, Bucket>;

impl Namespace {
    /// This namespace's digest (cached).
    pub fn digest(&self) -> [u8; 32] {
        *self.digest.get_or_init(|| {
            let buckets = self.buckets.get_or_init(|| {
                let mut buckets = Buckets::new();
                for (key, doc) in self.docs.iter() {
                    buckets.entry(bucket_of(key)).or_default().docs.insert(key.clone(), *doc.hash());
                }
                buckets
            });
            let mut hasher = Sha256::new();
            for (number, bucket) in buckets.iter() {
                hasher.update([*number]);
                hasher.update(bucket.digest());
            }
            hasher.finalize().into()
        })
    }

    /// Forgets the digests a write of `key` changes, keeping the bucket index up to date if a
    /// digest built it (which then hashes the new document). The bucket keeps `key` itself:
    /// the documents' map holds the same allocation.
    pub(super) fn forget_written(&mut self, key: &Arc<str>, doc: &Doc) {
        let Some(buckets) = self.forget_whole_digest() else { return };
        let bucket = buckets.entry(bucket_of(key)).or_default();
        bucket.docs.insert(key.clone(), *doc.hash());
        bucket.digest = OnceLock::new();
    }

    /// Forgets the digests a delete of `key` changes, keeping the bucket index up to date.
    pub(super) fn forget_deleted(&mut self, key: &str) {
        let Some(buckets) = self.forget_whole_digest() else { return };
        let number = bucket_of(key);
        if let Some(bucket) = buckets.get_mut(&number) {
            bucket.docs.remove(key);
            bucket.digest = OnceLock::new();
            if bucket.docs.is_empty() {
                buckets.remove(&number);
            }
        }
    }

    /// Forgets the namespace's digest, and returns its bucket index if a digest built one.
    fn forget_whole_digest(&mut self) -> Option<&mut Buckets> {
        self.digest = OnceLock::new();
        self.buckets.get_mut()
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
        crate::json::lower_hex(&hasher.finalize())
    }

    /// Overall and per-namespace digests.
    pub fn digests(&self) -> Digests {
        Digests {
            overall: self.digest(),
            namespaces: self.namespaces().map(|(ns, n)| (ns.clone(), crate::json::lower_hex(&n.digest()))).collect(),
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
    let parse = |doc: Option<&Doc>| doc.map(|d| serde_json::from_str::<Value>(&d.text).unwrap_or(Value::Null));
    let mut entries = Vec::new();
    each_changed_doc(
        before,
        after,
        |ns| !excluded.iter().any(|e| e == ns),
        |ns, key, change, a, b| {
            let (before, after) = (parse(a), parse(b));
            let mut fields = Vec::new();
            if let (Some(x), Some(y)) = (&before, &after) {
                changed_fields(x, y, String::new(), &mut fields);
            }
            entries.push(DiffEntry {
                namespace: ns.to_string(),
                key: key.to_string(),
                change: change.into(),
                fields,
                before,
                after,
            });
        },
    );
    entries
}

/// The documents of the namespaces in `only` that differ from `before` to `after`, as
/// `(namespace, key, change)`: what [`diff`] finds there, without reading the documents.
pub fn changed_keys(before: &State, after: &State, only: &[String]) -> Vec<(String, String, &'static str)> {
    let mut keys = Vec::new();
    each_changed_doc(
        before,
        after,
        |ns| only.iter().any(|o| o == ns),
        |ns, key, change, _, _| {
            keys.push((ns.to_string(), key.to_string(), change));
        },
    );
    keys
}

/// Calls `found(namespace, key, change, before, after)` for every document that differs,
/// in namespace and key order, in the namespaces `wanted` accepts.
fn each_changed_doc(
    before: &State,
    after: &State,
    wanted: impl Fn(&str) -> bool,
    mut found: impl FnMut(&str, &str, &'static str, Option<&Doc>, Option<&Doc>),
) {
    let mut names: Vec<&String> = before.namespaces().map(|(n, _)| n).collect();
    names.extend(after.namespaces().map(|(n, _)| n));
    names.sort();
    names.dedup();
    let empty = Namespace::default();
    for ns in names.into_iter().filter(|ns| wanted(ns)) {
        let (old, new) = (before.namespace(ns).unwrap_or(&empty), after.namespace(ns).unwrap_or(&empty));
        if old.digest() == new.digest() {
            continue;
        }
        // imbl skips the subtrees both versions share: O(what changed), not O(size).
        for item in old.docs.diff(&new.docs) {
            match item {
                DiffItem::Update { old: (key, a), new: (_, b) } => found(ns, key, "changed", Some(a), Some(b)),
                DiffItem::Remove(key, a) => found(ns, key, "removed", Some(a), None),
                DiffItem::Add(key, b) => found(ns, key, "added", None, Some(b)),
            }
        }
    }
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
    fn a_written_key_is_one_allocation_shared_by_the_documents_and_the_digest() {
        let store = MemoryStore::new(state());
        store.snapshot().namespace("users").unwrap().digest(); // the buckets exist from here on
        let mut write = Txn::new(store.snapshot(), WriteQuota::default());
        write.put("users", "u2", r#"{"name":"Grace"}"#).unwrap();
        store.commit(&write).unwrap();
        let users = store.snapshot().namespace("users").unwrap().clone();
        let (in_docs, _) = users.docs.get_key_value("u2").unwrap();
        let bucket = &users.buckets.get().unwrap()[&bucket_of("u2")];
        let (in_bucket, _) = bucket.docs.get_key_value("u2").unwrap();
        // A node copied by a later write copies a reference count, not the key's text.
        assert!(Arc::ptr_eq(in_docs, in_bucket));
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

    /// Writes as `(namespace, key, document or None to delete)`, small alphabets so that
    /// writes hit the same keys, empty namespaces and shared buckets.
    fn writes() -> impl proptest::strategy::Strategy<Value = Vec<(u8, u16, Option<u8>)>> {
        proptest::collection::vec((0..3u8, 0..600u16, proptest::option::of(0..4u8)), 0..80)
    }

    fn apply_all(store: &MemoryStore, writes: &[(u8, u16, Option<u8>)]) {
        for (ns, key, doc) in writes {
            let mut txn = Txn::new(store.snapshot(), WriteQuota::default());
            let (ns, key) = (format!("ns{ns}"), format!("k{key}"));
            match doc {
                Some(n) => txn.put(&ns, &key, &json!({ "n": n }).to_string()).unwrap(),
                None => drop(txn.delete(&ns, &key).unwrap()),
            }
            store.commit(&txn).unwrap();
        }
    }

    /// A big starting state: every bucket of `ns0` holds documents.
    fn big() -> State {
        let docs: serde_json::Map<String, Value> = (0..600).map(|k| (format!("k{k}"), json!({ "n": k % 7 }))).collect();
        State::from_json(&json!({ "ns0": docs, "ns1": { "k1": {} } })).unwrap()
    }

    proptest::proptest! {
        /// The bucket index kept up to date write by write gives the digest a state built
        /// from scratch with the same documents gives, and diffs list exactly the documents
        /// whose texts differ.
        #[test]
        fn digests_kept_up_to_date_equal_digests_from_scratch(first in writes(), second in writes()) {
            let initial = big();
            let before = initial.digests();
            let store = MemoryStore::new(initial.clone());
            apply_all(&store, &first);
            let middle = store.snapshot();
            let middle_digests = middle.digests();
            apply_all(&store, &second);
            let after = store.snapshot();
            let scratch = State::from_json(&after.to_json()).unwrap();
            proptest::prop_assert_eq!(after.digests(), scratch.digests());
            proptest::prop_assert_eq!(
                State::from_json(&middle.to_json()).unwrap().digests(), middle_digests
            );
            // The snapshots taken earlier still digest as they did, and their bucket index,
            // shared with the later states, still describes them: writes on top of `initial`
            // again digest as a state built from scratch.
            proptest::prop_assert_eq!(initial.digests(), before);
            let again = MemoryStore::new(initial.clone());
            apply_all(&again, &second);
            let again = again.snapshot();
            proptest::prop_assert_eq!(again.digests(), State::from_json(&again.to_json()).unwrap().digests());
            let expected: Vec<(String, String)> = {
                let (a, b) = (initial.to_json(), after.to_json());
                let mut keys = Vec::new();
                for ns in ["ns0", "ns1", "ns2"] {
                    let mut names: Vec<&String> = a.get(ns).and_then(Value::as_object).into_iter().flat_map(|m| m.keys())
                        .chain(b.get(ns).and_then(Value::as_object).into_iter().flat_map(|m| m.keys())).collect();
                    names.sort();
                    names.dedup();
                    for key in names {
                        if a.pointer(&format!("/{ns}/{key}")) != b.pointer(&format!("/{ns}/{key}")) {
                            keys.push((ns.to_string(), key.clone()));
                        }
                    }
                }
                keys
            };
            let listed: Vec<(String, String)> =
                diff(&initial, &after, &[]).into_iter().map(|d| (d.namespace, d.key)).collect();
            proptest::prop_assert_eq!(&listed, &expected);
            // changed_keys lists the same documents of the namespaces asked for, unread.
            let only = ["ns0".to_string(), "ns2".to_string()];
            let keys: Vec<(String, String)> =
                changed_keys(&initial, &after, &only).into_iter().map(|(ns, key, _)| (ns, key)).collect();
            let wanted: Vec<(String, String)> = expected.into_iter().filter(|(ns, _)| only.contains(ns)).collect();
            proptest::prop_assert_eq!(keys, wanted);
        }
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
        assert_eq!(
            changed_keys(&initial, &store.snapshot(), &["reservations".into(), "users".into()]),
            [("reservations".to_string(), "R1".to_string(), "added")]
        );
        assert_ne!(store.snapshot().digest_excluding(&["users".into()]), initial.digest_excluding(&["users".into()]));
    }
}
