//! The host-side state store: namespaces of canonical JSON documents.
//!
//! A [`State`] is an immutable value built on persistent maps, so taking a snapshot is O(1)
//! and every verification case can start from the same one. A call works in a [`Txn`] over a
//! snapshot: it reads the snapshot and its own writes, and its writes reach the store only
//! when [`MemoryStore::commit`] accepts the transaction. Commits are optimistic: a
//! transaction whose reads another commit has changed since its snapshot is refused with
//! [`Conflict`] and the caller runs the call again on a fresh snapshot.

mod digest;
pub mod fixture;
mod found;
pub mod generate;
mod txn;
pub mod undo;

use std::sync::{Arc, OnceLock, RwLock};

use imbl::OrdMap;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::sync::{read, write};

pub use digest::{Diff, DiffEntry, Digests, changed_keys, diff};
pub use txn::{Conflict, FieldIs, StoreCaps, Txn, TxnError, WriteQuota};

/// One stored document.
#[derive(Clone, Debug)]
pub struct Doc {
    /// Canonical JSON text.
    pub text: Arc<str>,
    /// SHA-256 of `text`, hashed when a digest first needs it (a run that is never digested
    /// never pays for it) and kept, so that digests need not hash the document again.
    hash: OnceLock<[u8; 32]>,
    /// The commit that wrote it; optimistic concurrency compares these.
    pub version: u64,
}

/// Documents are equal when their texts are (whichever commit wrote them).
impl PartialEq for Doc {
    fn eq(&self, other: &Doc) -> bool {
        match (self.hash.get(), other.hash.get()) {
            (Some(a), Some(b)) => a == b,
            _ => Arc::ptr_eq(&self.text, &other.text) || self.text == other.text,
        }
    }
}

impl Doc {
    fn new(text: Arc<str>, version: u64) -> Doc {
        Doc { text, hash: OnceLock::new(), version }
    }

    /// SHA-256 of the text.
    pub fn hash(&self) -> &[u8; 32] {
        self.hash.get_or_init(|| Sha256::digest(self.text.as_bytes()).into())
    }
}

/// The documents of one namespace.
#[derive(Clone, Debug, Default)]
pub struct Namespace {
    /// Keys shared, not owned: a write copies its B-tree node, and with it every key there
    /// (64 a node), so owned strings cost an allocation each.
    docs: OrdMap<Arc<str>, Doc>,
    /// The commit that last added or removed a key: `list` results depend on it.
    keys_version: u64,
    /// The namespace's digest, computed on first use after a change.
    digest: OnceLock<[u8; 32]>,
    /// Its documents' hashes by digest bucket, indexed by the first digest and kept up to
    /// date by writes after it (see `digest`).
    buckets: OnceLock<digest::Buckets>,
    /// Finds answered on these documents, forgotten by a write (see `found`).
    finds: found::Memo,
}

impl Namespace {
    pub fn get(&self, key: &str) -> Option<&Doc> {
        self.docs.get(key)
    }

    pub fn len(&self) -> usize {
        self.docs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.docs.is_empty()
    }

    /// Documents in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Doc)> {
        self.docs.iter().map(|(k, d)| (&**k, d))
    }

    /// Keys that start with `prefix`, in order.
    pub fn keys_with_prefix<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.with_prefix(prefix).map(|(k, _)| k)
    }

    /// Documents whose keys start with `prefix`, in key order.
    pub fn with_prefix<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = (&'a str, &'a Doc)> + 'a {
        use std::ops::Bound;
        self.docs
            .range::<_, str>((Bound::Included(prefix), Bound::Unbounded))
            .map(|(k, d)| (&**k, d))
            .take_while(move |(k, _)| k.starts_with(prefix))
    }

    /// Whether both hold the very same documents (one is an unchanged copy of the other).
    pub(crate) fn shares_docs_with(&self, other: &Namespace) -> bool {
        self.docs.ptr_eq(&other.docs)
    }
}

/// An immutable value of the whole store. Cloning it is O(1).
#[derive(Clone, Debug, Default)]
pub struct State {
    namespaces: OrdMap<String, Namespace>,
    /// The last commit applied to this value.
    version: u64,
}

impl State {
    pub fn namespace(&self, ns: &str) -> Option<&Namespace> {
        self.namespaces.get(ns)
    }

    pub fn get(&self, ns: &str, key: &str) -> Option<&Doc> {
        self.namespaces.get(ns)?.get(key)
    }

    /// Namespaces in name order (empty ones included).
    pub fn namespaces(&self) -> impl Iterator<Item = (&String, &Namespace)> {
        self.namespaces.iter()
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    /// Number of documents over all namespaces.
    pub fn doc_count(&self) -> usize {
        self.namespaces.values().map(Namespace::len).sum()
    }

    /// Builds a state from `{namespace: {key: document}}`.
    pub fn from_json(value: &Value) -> Result<State, String> {
        let namespaces = value.as_object().ok_or("the top level must be an object of namespaces")?;
        let mut state = State { version: 1, ..State::default() };
        for (ns, docs) in namespaces {
            let docs = docs.as_object().ok_or_else(|| format!("namespace '{ns}' must be an object of documents"))?;
            let mut namespace = Namespace::default();
            for (key, doc) in docs {
                let text: Arc<str> = crate::json::canonical(doc).into();
                namespace.docs.insert(key.as_str().into(), Doc::new(text, 1));
            }
            // Empty namespaces do not exist (see `digest`).
            if !namespace.is_empty() {
                state.namespaces.insert(ns.clone(), namespace);
            }
        }
        Ok(state)
    }

    /// Builds a state from stored documents `(namespace, key, canonical text, version)`,
    /// the key-set versions of namespaces, and the last commit's version.
    pub fn from_versioned(
        docs: impl IntoIterator<Item = (String, String, String, u64)>,
        keys_versions: impl IntoIterator<Item = (String, u64)>,
        version: u64,
    ) -> State {
        let mut state = State { version, ..State::default() };
        for (ns, key, text, doc_version) in docs {
            let namespace = state.namespaces.entry(ns).or_default();
            namespace.docs.insert(key.into(), Doc::new(text.into(), doc_version));
        }
        for (ns, keys_version) in keys_versions {
            if let Some(namespace) = state.namespaces.get_mut(&ns) {
                namespace.keys_version = keys_version;
            }
        }
        state
    }

    /// The whole store as `{namespace: {key: document}}`.
    pub fn to_json(&self) -> Value {
        let mut out = serde_json::Map::new();
        for (ns, namespace) in self.namespaces() {
            let docs = namespace
                .iter()
                .map(|(k, d)| (k.to_string(), serde_json::from_str(&d.text).unwrap_or(Value::Null)))
                .collect();
            out.insert(ns.clone(), Value::Object(docs));
        }
        Value::Object(out)
    }

    /// The whole store as canonical JSON text, written without re-serializing documents.
    pub fn to_canonical_json(&self) -> String {
        let mut out = String::with_capacity(64);
        out.push('{');
        for (i, (ns, namespace)) in self.namespaces().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&Value::String(ns.clone()).to_string());
            out.push_str(":{");
            for (j, (key, doc)) in namespace.iter().enumerate() {
                if j > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(key.to_string()).to_string());
                out.push(':');
                out.push_str(&doc.text);
            }
            out.push('}');
        }
        out.push('}');
        out
    }

    /// Applies writes as commit `version`. `None` deletes.
    pub(crate) fn apply<'a>(
        &mut self,
        version: u64,
        writes: impl IntoIterator<Item = (&'a str, &'a str, Option<&'a Arc<str>>)>,
    ) {
        for (ns, key, text) in writes {
            // A write to an existing namespace allocates no copy of its name.
            if !self.namespaces.contains_key(ns) {
                if text.is_none() {
                    continue; // a delete from a namespace that does not exist changes nothing
                }
                self.namespaces.insert(ns.to_string(), Namespace::default());
            }
            let Some(namespace) = self.namespaces.get_mut(ns) else { continue };
            namespace.finds = found::Memo::default();
            let existed = match text {
                Some(text) => {
                    // One allocation for the key, shared by the documents and the digest buckets.
                    let key: Arc<str> = key.into();
                    let doc = Doc::new(text.clone(), version);
                    namespace.forget_written(&key, &doc);
                    namespace.docs.insert(key, doc).is_some()
                }
                None => {
                    namespace.forget_deleted(key);
                    namespace.docs.remove(key).is_some()
                }
            };
            if existed != text.is_some() {
                namespace.keys_version = version;
            }
            if namespace.is_empty() {
                self.namespaces.remove(ns);
            }
        }
        self.version = version;
    }
}

/// One document's change, as a commit reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    pub namespace: String,
    pub key: String,
    pub before: Option<Arc<str>>,
    pub after: Option<Arc<str>>,
}

/// The in-memory store: the current [`State`] behind a lock held only to swap values.
#[derive(Debug, Default)]
pub struct MemoryStore {
    current: RwLock<State>,
}

impl MemoryStore {
    pub fn new(state: State) -> MemoryStore {
        MemoryStore { current: RwLock::new(state) }
    }

    /// The current state; O(1).
    pub fn snapshot(&self) -> State {
        read(&self.current).clone()
    }

    /// Replaces the whole state (a verification case starting over).
    pub fn reset(&self, state: State) {
        *write(&self.current) = state;
    }

    /// Applies `txn` if nothing it read has changed since its snapshot; returns the changes.
    pub fn commit(&self, txn: &Txn) -> Result<Vec<Change>, Conflict> {
        if txn.is_read_only() {
            return Ok(Vec::new());
        }
        let mut current = write(&self.current);
        txn.validate(&current)?;
        let changes = txn.changes(&current);
        let version = current.version + 1;
        current.apply(version, txn.writes());
        Ok(changes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample() -> State {
        State::from_json(&json!({
            "flights": { "HAT001": { "seats": 3 }, "HAT002": { "seats": 0 } },
            "users": { "u1": { "name": "Ada" } }
        }))
        .unwrap()
    }

    #[test]
    fn fixture_round_trips_through_canonical_json() {
        let state = sample();
        let text = state.to_canonical_json();
        assert_eq!(text, r#"{"flights":{"HAT001":{"seats":3},"HAT002":{"seats":0}},"users":{"u1":{"name":"Ada"}}}"#);
        let again = State::from_json(&serde_json::from_str(&text).unwrap()).unwrap();
        assert_eq!(again.to_canonical_json(), text);
    }

    #[test]
    fn prefix_listing_stops_at_the_prefix() {
        let state = sample();
        let keys: Vec<_> = state.namespace("flights").unwrap().keys_with_prefix("HAT00").collect();
        assert_eq!(keys, ["HAT001", "HAT002"]);
        assert_eq!(state.namespace("flights").unwrap().keys_with_prefix("HAT002").count(), 1);
        assert_eq!(state.namespace("flights").unwrap().keys_with_prefix("X").count(), 0);
    }

    #[test]
    fn snapshots_do_not_see_later_commits() {
        let store = MemoryStore::new(sample());
        let before = store.snapshot();
        let mut txn = Txn::new(store.snapshot(), WriteQuota::default());
        txn.put("flights", "HAT001", r#"{"seats":2}"#).unwrap();
        store.commit(&txn).unwrap();
        assert_eq!(&*before.get("flights", "HAT001").unwrap().text, r#"{"seats":3}"#);
        assert_eq!(&*store.snapshot().get("flights", "HAT001").unwrap().text, r#"{"seats":2}"#);
    }

    #[test]
    fn a_commit_hashes_nothing_until_a_digest_needs_it() {
        let store = MemoryStore::new(sample());
        let mut txn = Txn::new(store.snapshot(), WriteQuota::default());
        txn.put("flights", "HAT001", r#"{"seats":2}"#).unwrap();
        store.commit(&txn).unwrap();
        let state = store.snapshot();
        let written = state.get("flights", "HAT001").unwrap();
        assert!(written.hash.get().is_none(), "the commit hashed the document it wrote");

        // A digest hashes it, keeps the hash, and equals the digest of the same documents
        // loaded afresh.
        let digest = state.digest();
        assert_eq!(written.hash.get(), Some(&Sha256::digest(br#"{"seats":2}"#).into()));
        let fresh = State::from_json(&serde_json::from_str(&state.to_canonical_json()).unwrap()).unwrap();
        assert_eq!(fresh.digest(), digest);

        // Equal texts are equal documents, hashed or not; different texts are not.
        let same = Doc::new(r#"{"seats":2}"#.into(), 9);
        let other = Doc::new(r#"{"seats":1}"#.into(), 9);
        assert_eq!(*written, same);
        assert_eq!(same, *written);
        assert_ne!(*written, other);
        assert_ne!(other, *written);
        same.hash();
        assert_eq!(*written, same);
    }
}
