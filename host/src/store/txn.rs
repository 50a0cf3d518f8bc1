//! A call's view of the store: a snapshot, the versions it read, and its buffered writes.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::{Change, State};

/// How much one call may write, so that a plugin cannot grow host memory through the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WriteQuota {
    /// Total bytes of documents written (canonical form).
    pub bytes: usize,
    /// Number of `put` and `delete` operations.
    pub writes: usize,
}

impl Default for WriteQuota {
    fn default() -> Self {
        WriteQuota { bytes: 4 << 20, writes: 1_000 }
    }
}

/// Why a write was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TxnError {
    #[error("document {namespace}/{key} is not valid JSON: {reason}")]
    InvalidDocument { namespace: String, key: String, reason: String },
    #[error("the call exceeded its write quota ({0})")]
    QuotaExceeded(String),
}

/// Another commit changed something this transaction read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{namespace}/{key} changed while the call ran")]
pub struct Conflict {
    pub namespace: String,
    pub key: String,
}

type Key = (String, String);

/// Reads and buffered writes of one call.
#[derive(Debug)]
pub struct Txn {
    base: State,
    quota: WriteQuota,
    /// Version of every document read from the snapshot (`None`: it was absent).
    reads: BTreeMap<Key, Option<u64>>,
    /// Namespaces listed, with their key-set version at the snapshot.
    listed: BTreeMap<String, u64>,
    /// Pending writes; `None` deletes.
    writes: BTreeMap<Key, Option<Arc<str>>>,
    bytes_written: usize,
    write_ops: usize,
}

impl Txn {
    pub fn new(base: State, quota: WriteQuota) -> Txn {
        Txn {
            base,
            quota,
            reads: BTreeMap::new(),
            listed: BTreeMap::new(),
            writes: BTreeMap::new(),
            bytes_written: 0,
            write_ops: 0,
        }
    }

    /// The snapshot this transaction reads.
    pub fn base(&self) -> &State {
        &self.base
    }

    pub fn get(&mut self, ns: &str, key: &str) -> Option<Arc<str>> {
        let id = (ns.to_string(), key.to_string());
        if let Some(pending) = self.writes.get(&id) {
            return pending.clone();
        }
        let doc = self.base.get(ns, key);
        self.reads.entry(id).or_insert(doc.map(|d| d.version));
        doc.map(|d| d.text.clone())
    }

    /// Stores `text` (JSON, canonicalized here) at `ns`/`key`.
    pub fn put(&mut self, ns: &str, key: &str, text: &str) -> Result<(), TxnError> {
        let canonical = crate::json::canonicalize(text).map_err(|e| TxnError::InvalidDocument {
            namespace: ns.to_string(),
            key: key.to_string(),
            reason: e.to_string(),
        })?;
        self.charge(canonical.len() + ns.len() + key.len())?;
        self.writes.insert((ns.to_string(), key.to_string()), Some(canonical.into()));
        Ok(())
    }

    /// Removes `ns`/`key`; true when it existed.
    pub fn delete(&mut self, ns: &str, key: &str) -> Result<bool, TxnError> {
        self.charge(ns.len() + key.len())?;
        let existed = self.get(ns, key).is_some();
        self.writes.insert((ns.to_string(), key.to_string()), None);
        Ok(existed)
    }

    /// Keys of `ns` starting with `prefix`, own writes included.
    pub fn list(&mut self, ns: &str, prefix: &str) -> Vec<String> {
        let namespace = self.base.namespace(ns);
        self.listed.entry(ns.to_string()).or_insert(namespace.map_or(0, |n| n.keys_version));
        let mut keys: std::collections::BTreeSet<String> =
            namespace.map(|n| n.keys_with_prefix(prefix).cloned().collect()).unwrap_or_default();
        for ((wns, key), text) in &self.writes {
            if wns == ns && key.starts_with(prefix) {
                if text.is_some() {
                    keys.insert(key.clone());
                } else {
                    keys.remove(key);
                }
            }
        }
        keys.into_iter().collect()
    }

    fn charge(&mut self, bytes: usize) -> Result<(), TxnError> {
        self.write_ops += 1;
        self.bytes_written += bytes;
        if self.write_ops > self.quota.writes {
            return Err(TxnError::QuotaExceeded(format!("more than {} writes", self.quota.writes)));
        }
        if self.bytes_written > self.quota.bytes {
            return Err(TxnError::QuotaExceeded(format!("more than {} bytes written", self.quota.bytes)));
        }
        Ok(())
    }

    pub fn is_read_only(&self) -> bool {
        self.writes.is_empty()
    }

    /// Pending writes in key order.
    pub fn writes(&self) -> impl Iterator<Item = (&str, &str, Option<&Arc<str>>)> {
        self.writes.iter().map(|((ns, key), text)| (ns.as_str(), key.as_str(), text.as_ref()))
    }

    /// Refuses the transaction if `current` differs from the snapshot in anything it read.
    pub fn validate(&self, current: &State) -> Result<(), Conflict> {
        for ((ns, key), version) in &self.reads {
            if current.get(ns, key).map(|d| d.version) != *version {
                return Err(Conflict { namespace: ns.clone(), key: key.clone() });
            }
        }
        for (ns, keys_version) in &self.listed {
            if current.namespace(ns).map_or(0, |n| n.keys_version) != *keys_version {
                return Err(Conflict { namespace: ns.clone(), key: "*".to_string() });
            }
        }
        Ok(())
    }

    /// What committing on top of `current` changes (writes of an identical document are not changes).
    pub fn changes(&self, current: &State) -> Vec<Change> {
        self.writes()
            .filter_map(|(ns, key, after)| {
                let before = current.get(ns, key).map(|d| d.text.clone());
                (before.as_ref() != after).then(|| Change {
                    namespace: ns.to_string(),
                    key: key.to_string(),
                    before,
                    after: after.cloned(),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::MemoryStore;
    use super::*;
    use serde_json::json;

    fn store() -> MemoryStore {
        MemoryStore::new(State::from_json(&json!({ "pools": { "p": { "allocated": 0 } } })).unwrap())
    }

    #[test]
    fn reads_see_own_writes_and_deletes() {
        let store = store();
        let mut txn = Txn::new(store.snapshot(), WriteQuota::default());
        txn.put("pools", "q", r#"{ "allocated": 5 }"#).unwrap();
        assert_eq!(txn.get("pools", "q").as_deref(), Some(r#"{"allocated":5}"#));
        assert_eq!(txn.list("pools", ""), ["p", "q"]);
        assert!(txn.delete("pools", "p").unwrap());
        assert_eq!(txn.get("pools", "p"), None);
        assert_eq!(txn.list("pools", ""), ["q"]);
    }

    #[test]
    fn a_stale_read_is_a_conflict_and_nothing_is_applied() {
        let store = store();
        let mut first = Txn::new(store.snapshot(), WriteQuota::default());
        let mut second = Txn::new(store.snapshot(), WriteQuota::default());
        first.get("pools", "p");
        first.put("pools", "p", r#"{"allocated":10}"#).unwrap();
        second.get("pools", "p");
        second.put("pools", "p", r#"{"allocated":20}"#).unwrap();
        store.commit(&first).unwrap();
        let err = store.commit(&second).unwrap_err();
        assert_eq!(err.key, "p");
        assert_eq!(&*store.snapshot().get("pools", "p").unwrap().text, r#"{"allocated":10}"#);
    }

    #[test]
    fn a_listing_conflicts_with_a_new_key() {
        let store = store();
        let mut lister = Txn::new(store.snapshot(), WriteQuota::default());
        lister.list("pools", "");
        lister.put("pools", "count", r#"{"n":1}"#).unwrap();
        let mut adder = Txn::new(store.snapshot(), WriteQuota::default());
        adder.put("pools", "new", "{}").unwrap();
        store.commit(&adder).unwrap();
        assert!(store.commit(&lister).is_err());
    }

    #[test]
    fn quotas_and_invalid_documents_are_refused() {
        let store = store();
        let mut txn = Txn::new(store.snapshot(), WriteQuota { bytes: 64, writes: 1 });
        assert!(matches!(txn.put("a", "b", "{"), Err(TxnError::InvalidDocument { .. })));
        txn.put("a", "b", "1").unwrap();
        assert!(matches!(txn.put("a", "c", "2"), Err(TxnError::QuotaExceeded(_))));
        let mut big = Txn::new(store.snapshot(), WriteQuota { bytes: 64, writes: 100 });
        let long = format!("\"{}\"", "x".repeat(100));
        assert!(matches!(big.put("a", "b", &long), Err(TxnError::QuotaExceeded(_))));
    }

    #[test]
    fn unchanged_rewrites_are_not_changes() {
        let store = store();
        let mut txn = Txn::new(store.snapshot(), WriteQuota::default());
        txn.put("pools", "p", r#"{"allocated":0.0}"#).unwrap();
        assert!(store.commit(&txn).unwrap().is_empty());
    }
}
