//! A call's view of the store: a snapshot, the versions it read, and its buffered writes.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::found::{Answer, Question};
use super::{Change, Namespace, State};

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

/// Caps on what one call can make the host hold through reads and listings (writes are
/// bounded by the [`WriteQuota`]). Every key and namespace a call names is copied and kept
/// until the call ends, so both their size and their number are capped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StoreCaps {
    /// Longest key (bytes) a call may read, write or list by (as a prefix).
    pub key_bytes: usize,
    /// Longest namespace name (bytes).
    pub namespace_bytes: usize,
    /// Distinct documents one call may read (its read set).
    pub distinct_reads: usize,
    /// Keys one `list` may return, or one `find` may look at.
    pub listed_keys: usize,
    /// Conditions of one `find`. A find runs in the host, where the call's deadline cannot
    /// stop it: its work is bounded by the documents it looks at times its conditions.
    #[serde(default = "default_find_conditions")]
    pub find_conditions: usize,
}

fn default_find_conditions() -> usize {
    32
}

impl Default for StoreCaps {
    fn default() -> Self {
        StoreCaps {
            key_bytes: 1024,
            namespace_bytes: 256,
            distinct_reads: 50_000,
            listed_keys: 50_000,
            find_conditions: default_find_conditions(),
        }
    }
}

/// Why a store operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TxnError {
    #[error("document {namespace}/{key} is not valid JSON: {reason}")]
    InvalidDocument { namespace: String, key: String, reason: String },
    #[error("a find in {namespace} has a condition on '{path}' whose value is not valid JSON: {reason}")]
    InvalidCondition { namespace: String, path: String, reason: String },
    #[error("the call exceeded its write quota ({0})")]
    QuotaExceeded(String),
    /// A [`StoreCaps`] cap: `cap` names it, `limit` says its value.
    #[error("the call exceeded the store's {cap} cap ({limit}): {detail}")]
    CapExceeded { cap: &'static str, limit: String, detail: String },
}

/// Another commit changed something this transaction read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{namespace}/{key} changed while the call ran")]
pub struct Conflict {
    pub namespace: String,
    pub key: String,
}

/// A condition of [`Txn::try_find`]: the value at `path` (field names from the top) is
/// `value`, JSON text. The tools' own type: the host and the toolkit share one definition.
pub use sagabox_toolkit::FieldIs;

/// A [`FieldIs`] ready to test documents with: its value canonical, as documents are, and
/// the text that a document holding it must contain (`"field":value`), which a fast search
/// looks for before the exact test reads the document's structure.
struct Test<'c> {
    path: &'c [String],
    value: std::borrow::Cow<'c, str>,
    member: Option<memchr::memmem::Finder<'static>>,
}

impl Test<'_> {
    fn holds(&self, text: &str) -> bool {
        self.member.as_ref().is_none_or(|member| member.find(text.as_bytes()).is_some())
            && sagabox_toolkit::json_text::holds(text, self.path, &self.value)
    }
}

/// Values by namespace, then key: looked up with borrowed names, so a read of a document the
/// call already read allocates nothing (a `(String, String)` key would need both copied).
#[derive(Clone, Debug)]
struct ByDoc<V> {
    by_ns: BTreeMap<String, BTreeMap<String, V>>,
    len: usize,
}

impl<V> Default for ByDoc<V> {
    fn default() -> Self {
        ByDoc { by_ns: BTreeMap::new(), len: 0 }
    }
}

impl<V> ByDoc<V> {
    fn get(&self, ns: &str, key: &str) -> Option<&V> {
        self.by_ns.get(ns)?.get(key)
    }

    fn contains(&self, ns: &str, key: &str) -> bool {
        self.get(ns, key).is_some()
    }

    /// The keys of `ns`, made empty the first time (the name is copied once per namespace).
    fn keys_of<'a>(by_ns: &'a mut BTreeMap<String, BTreeMap<String, V>>, ns: &str) -> &'a mut BTreeMap<String, V> {
        if !by_ns.contains_key(ns) {
            by_ns.insert(ns.to_string(), BTreeMap::new());
        }
        by_ns.get_mut(ns).expect("inserted above")
    }

    /// Sets `ns`/`key` to `value`, replacing what was there.
    fn insert(&mut self, ns: &str, key: &str, value: V) {
        let keys = Self::keys_of(&mut self.by_ns, ns);
        match keys.get_mut(key) {
            Some(slot) => *slot = value,
            None => {
                keys.insert(key.to_string(), value);
                self.len += 1;
            }
        }
    }

    /// Sets `ns`/`key` to `value` unless it holds one already.
    fn insert_new(&mut self, ns: &str, key: &str, value: V) {
        let keys = Self::keys_of(&mut self.by_ns, ns);
        if !keys.contains_key(key) {
            keys.insert(key.to_string(), value);
            self.len += 1;
        }
    }

    /// The entries of `ns` whose key starts with `prefix`, in key order.
    fn with_prefix<'a>(&'a self, ns: &str, prefix: &'a str) -> impl Iterator<Item = (&'a String, &'a V)> + 'a {
        let keys = self.by_ns.get(ns);
        keys.into_iter()
            .flat_map(move |keys| keys.range::<str, _>((std::ops::Bound::Included(prefix), std::ops::Bound::Unbounded)))
            .take_while(move |(key, _)| key.starts_with(prefix))
    }

    /// Every entry, in (namespace, key) order.
    fn iter(&self) -> impl Iterator<Item = (&str, &str, &V)> {
        self.by_ns.iter().flat_map(|(ns, keys)| keys.iter().map(move |(key, v)| (ns.as_str(), key.as_str(), v)))
    }
}

/// Reads and buffered writes of one call.
#[derive(Clone, Debug)]
pub struct Txn {
    base: State,
    quota: WriteQuota,
    caps: StoreCaps,
    /// Version of every document read from the snapshot (`None`: it was absent).
    reads: ByDoc<Option<u64>>,
    /// Namespaces listed, with their key-set version at the snapshot.
    listed: BTreeMap<String, u64>,
    /// Key ranges read whole by a find: (namespace, prefix). Recorded as ranges rather than
    /// document by document, since a find looks at every document of its range.
    scanned: Vec<(String, String)>,
    /// Pending writes; `None` deletes.
    writes: ByDoc<Option<Arc<str>>>,
    bytes_written: usize,
    write_ops: usize,
}

impl Txn {
    pub fn new(base: State, quota: WriteQuota) -> Txn {
        Txn {
            base,
            quota,
            caps: StoreCaps::default(),
            reads: ByDoc::default(),
            listed: BTreeMap::new(),
            scanned: Vec::new(),
            writes: ByDoc::default(),
            bytes_written: 0,
            write_ops: 0,
        }
    }

    /// The same transaction with other caps on reads and listings.
    pub fn with_caps(mut self, caps: StoreCaps) -> Txn {
        self.caps = caps;
        self
    }

    /// The snapshot this transaction reads.
    pub fn base(&self) -> &State {
        &self.base
    }

    pub fn get(&mut self, ns: &str, key: &str) -> Option<Arc<str>> {
        if let Some(pending) = self.writes.get(ns, key) {
            return pending.clone();
        }
        let doc = self.base.get(ns, key);
        self.reads.insert_new(ns, key, doc.map(|d| d.version));
        doc.map(|d| d.text.clone())
    }

    /// [`Txn::get`] for a guest: refuses names over the caps and a read that would grow the
    /// read set past its cap.
    pub fn try_get(&mut self, ns: &str, key: &str) -> Result<Option<Arc<str>>, TxnError> {
        self.check_names(ns, key)?;
        // Only a call already at the cap pays for the lookups that tell a new read.
        let at_cap = self.reads.len >= self.caps.distinct_reads;
        if at_cap && !self.writes.contains(ns, key) && !self.reads.contains(ns, key) {
            let limit = format!("{} distinct documents per call", self.caps.distinct_reads);
            return Err(cap("read set", limit, format!("reading {ns}/{} would exceed it", short(key))));
        }
        Ok(self.get(ns, key))
    }

    /// Stores `text` (JSON, canonicalized here) at `ns`/`key`. The quota is checked against
    /// the raw text before parsing, so a document that cannot fit is never parsed.
    pub fn put(&mut self, ns: &str, key: &str, text: &str) -> Result<(), TxnError> {
        self.check_names(ns, key)?;
        self.check_room(text.len() + ns.len() + key.len())?;
        let canonical = crate::json::canonicalize(text).map_err(|e| TxnError::InvalidDocument {
            namespace: ns.to_string(),
            key: key.to_string(),
            reason: e.to_string(),
        })?;
        self.charge(canonical.len() + ns.len() + key.len())?;
        self.writes.insert(ns, key, Some(Arc::from(&*canonical)));
        Ok(())
    }

    /// Removes `ns`/`key`; true when it existed.
    pub fn delete(&mut self, ns: &str, key: &str) -> Result<bool, TxnError> {
        self.check_names(ns, key)?;
        self.charge(ns.len() + key.len())?;
        let existed = self.get(ns, key).is_some();
        self.writes.insert(ns, key, None);
        Ok(existed)
    }

    /// Keys of `ns` starting with `prefix`, own writes included.
    pub fn list(&mut self, ns: &str, prefix: &str) -> Vec<String> {
        self.keys(ns, prefix, usize::MAX)
    }

    /// [`Txn::list`] for a guest: refuses names over the caps and listings longer than the
    /// cap, without collecting more than the cap (plus the call's own deletions) first.
    pub fn try_list(&mut self, ns: &str, prefix: &str) -> Result<Vec<String>, TxnError> {
        self.check_names(ns, prefix)?;
        let keys = self.keys(ns, prefix, self.caps.listed_keys.saturating_add(1));
        if keys.len() > self.caps.listed_keys {
            return Err(self.listing_cap(ns, prefix));
        }
        Ok(keys)
    }

    /// The documents of `ns` whose keys start with `prefix` and that hold every condition,
    /// own writes included. The whole range counts as read: a change to any document in it
    /// (or a key added to it or removed) conflicts, as after a `list` and a `get` of each key.
    /// It looks at no more documents than a listing may return.
    pub fn try_find(
        &mut self,
        ns: &str,
        prefix: &str,
        conditions: &[FieldIs],
    ) -> Result<Vec<(String, Arc<str>)>, TxnError> {
        self.check_names(ns, prefix)?;
        if conditions.len() > self.caps.find_conditions {
            let limit = format!("{} conditions per find", self.caps.find_conditions);
            return Err(cap("find conditions", limit, format!("a find in {ns} with {} conditions", conditions.len())));
        }
        let tests = conditions.iter().map(|c| self.test(ns, c)).collect::<Result<Vec<_>, _>>()?;
        let answer = self.answer(ns, prefix, &tests);
        if answer.looked_at > self.caps.listed_keys {
            return Err(self.listing_cap(ns, prefix));
        }
        let found = answer.found.clone();
        if !self.scanned.iter().any(|(n, p)| n == ns && prefix.starts_with(p.as_str())) {
            self.scanned.push((ns.to_string(), prefix.to_string()));
        }
        Ok(found)
    }

    /// What a find of `tests` over `prefix` in `ns` finds: the answer the namespace kept for
    /// the same question, or a scan (kept for the next one when it read the whole range).
    fn answer(&self, ns: &str, prefix: &str, tests: &[Test<'_>]) -> Arc<Answer> {
        // The namespace's memo answers only for its own documents: not over this call's writes.
        let Some(namespace) = self.base.namespace(ns).filter(|_| self.writes.with_prefix(ns, prefix).next().is_none())
        else {
            return Arc::new(self.scan(ns, prefix, tests));
        };
        let question = Question {
            prefix: prefix.to_string(),
            conditions: tests.iter().map(|t| FieldIs { path: t.path.to_vec(), value: t.value.to_string() }).collect(),
        };
        if let Some(answer) = namespace.finds.get(&question) {
            return answer;
        }
        let answer = Arc::new(self.scan(ns, prefix, tests));
        // Only a whole range is kept: a call with a larger cap must not get a cut one.
        if answer.looked_at <= self.caps.listed_keys {
            namespace.finds.keep(question, answer.clone());
        }
        answer
    }

    /// The documents of `ns` starting with `prefix` that pass every test, reading at most one
    /// more than the listing cap allows.
    fn scan(&self, ns: &str, prefix: &str, tests: &[Test<'_>]) -> Answer {
        let mut answer = Answer { looked_at: 0, found: Vec::new() };
        for (key, text) in self.range(ns, prefix).take(self.caps.listed_keys.saturating_add(1)) {
            answer.looked_at += 1;
            if tests.iter().all(|test| test.holds(text)) {
                answer.found.push((key.to_string(), text.clone()));
            }
        }
        answer
    }

    /// The documents of `ns` whose keys start with `prefix`, in key order, as this call sees
    /// them: the snapshot's with the call's own writes laid over them.
    fn range<'a>(&'a self, ns: &str, prefix: &'a str) -> impl Iterator<Item = (&'a str, &'a Arc<str>)> + 'a {
        let snapshot = self.base.namespace(ns).into_iter().flat_map(move |n| n.with_prefix(prefix));
        let mut snapshot = snapshot.map(|(key, doc)| (key, Some(&doc.text))).peekable();
        let mut written =
            self.writes.with_prefix(ns, prefix).map(|(key, text)| (key.as_str(), text.as_ref())).peekable();
        std::iter::from_fn(move || {
            let next = match (snapshot.peek(), written.peek()) {
                (Some((a, _)), Some((b, _))) if a < b => snapshot.next(),
                (Some((a, _)), Some((b, _))) if a == b => {
                    snapshot.next();
                    written.next()
                }
                (Some(_), Some(_)) | (None, Some(_)) => written.next(),
                (Some(_), None) => snapshot.next(),
                (None, None) => None,
            };
            Some(next)
        })
        .map_while(|next| next)
        .filter_map(|(key, text)| Some((key, text?)))
    }

    /// A listing or a find over more keys than the cap.
    fn listing_cap(&self, ns: &str, prefix: &str) -> TxnError {
        let detail = format!("{ns} has more keys starting with '{}'", short(prefix));
        cap("list size", format!("{} keys per listing", self.caps.listed_keys), detail)
    }

    fn test<'c>(&self, ns: &str, condition: &'c FieldIs) -> Result<Test<'c>, TxnError> {
        for field in &condition.path {
            self.check_names(ns, field)?;
        }
        let value = crate::json::canonicalize(&condition.value).map_err(|e| TxnError::InvalidCondition {
            namespace: ns.to_string(),
            path: short(&condition.path.join(".")).to_string(),
            reason: e.to_string(),
        })?;
        let member = condition.path.last().map(|field| {
            let needle = format!("{}:{value}", crate::json::canonical(&serde_json::Value::from(field.as_str())));
            memchr::memmem::Finder::new(needle.as_bytes()).into_owned()
        });
        Ok(Test { path: &condition.path, value, member })
    }

    /// The first `take` keys of `ns` starting with `prefix`, as this call sees them.
    fn keys(&mut self, ns: &str, prefix: &str, take: usize) -> Vec<String> {
        let keys_version = self.base.namespace(ns).map_or(0, |n| n.keys_version);
        self.listed.entry(ns.to_string()).or_insert(keys_version);
        self.range(ns, prefix).take(take).map(|(key, _)| key.to_string()).collect()
    }

    fn check_names(&self, ns: &str, key: &str) -> Result<(), TxnError> {
        if ns.len() > self.caps.namespace_bytes {
            let limit = format!("{} bytes", self.caps.namespace_bytes);
            return Err(cap("namespace length", limit, format!("a namespace of {} bytes", ns.len())));
        }
        if key.len() > self.caps.key_bytes {
            let limit = format!("{} bytes", self.caps.key_bytes);
            return Err(cap("key length", limit, format!("a key of {} bytes", key.len())));
        }
        Ok(())
    }

    /// Refuses a write of `bytes` that cannot fit, without charging anything.
    fn check_room(&self, bytes: usize) -> Result<(), TxnError> {
        if self.write_ops >= self.quota.writes {
            return Err(TxnError::QuotaExceeded(format!("more than {} writes", self.quota.writes)));
        }
        if self.bytes_written.saturating_add(bytes) > self.quota.bytes {
            return Err(TxnError::QuotaExceeded(format!(
                "more than {} bytes written (this document is {bytes} bytes)",
                self.quota.bytes
            )));
        }
        Ok(())
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
        self.writes.len == 0
    }

    /// Pending writes in key order.
    pub fn writes(&self) -> impl Iterator<Item = (&str, &str, Option<&Arc<str>>)> {
        self.writes.iter().map(|(ns, key, text)| (ns, key, text.as_ref()))
    }

    /// Refuses the transaction if `current` differs from the snapshot in anything it read.
    pub fn validate(&self, current: &State) -> Result<(), Conflict> {
        for (ns, key, version) in self.reads.iter() {
            if current.get(ns, key).map(|d| d.version) != *version {
                return Err(Conflict { namespace: ns.to_string(), key: key.to_string() });
            }
        }
        for (ns, keys_version) in &self.listed {
            if current.namespace(ns).map_or(0, |n| n.keys_version) != *keys_version {
                return Err(Conflict { namespace: ns.clone(), key: "*".to_string() });
            }
        }
        for (ns, prefix) in &self.scanned {
            if let Some(key) = first_difference(self.base.namespace(ns), current.namespace(ns), prefix) {
                return Err(Conflict { namespace: ns.clone(), key });
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

/// The first key starting with `prefix` whose document differs (or exists in one only)
/// between two versions of a namespace; None when the range is the same in both.
fn first_difference(before: Option<&Namespace>, after: Option<&Namespace>, prefix: &str) -> Option<String> {
    if let (Some(b), Some(a)) = (before, after)
        && b.shares_docs_with(a)
    {
        return None;
    }
    let (mut before, mut after) = (versions(before, prefix), versions(after, prefix));
    loop {
        match (before.next(), after.next()) {
            (None, None) => return None,
            (b, a) if b == a => continue,
            (Some((b, _)), Some((a, _))) => return Some(b.min(a).to_string()),
            (Some((key, _)), None) | (None, Some((key, _))) => return Some(key.to_string()),
        }
    }
}

fn versions<'a>(namespace: Option<&'a Namespace>, prefix: &'a str) -> impl Iterator<Item = (&'a str, u64)> + 'a {
    namespace.into_iter().flat_map(move |n| n.with_prefix(prefix)).map(|(key, doc)| (key, doc.version))
}

fn cap(cap: &'static str, limit: String, detail: String) -> TxnError {
    TxnError::CapExceeded { cap, limit, detail }
}

/// The start of a guest-supplied name, for messages.
fn short(name: &str) -> &str {
    let end = (0..=name.len().min(64)).rev().find(|i| name.is_char_boundary(*i)).unwrap_or(0);
    &name[..end]
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

    fn flights() -> MemoryStore {
        let flights = json!({
            "A1": { "origin": "SFO", "seats": 3, "dates": { "d1": { "origin": "JFK" } } },
            "A2": { "origin": "JFK", "seats": 3.0, "note": "\"origin\":\"SFO\"" },
            "A3": { "origin": "SFO", "seats": 2, "extra": { "b": 1, "a": [1, 2.0] } },
            "B1": { "origin": "SFO", "seats": 3 },
        });
        MemoryStore::new(State::from_json(&json!({ "flights": flights })).unwrap())
    }

    fn is(path: &[&str], value: &str) -> FieldIs {
        FieldIs { path: path.iter().map(|p| p.to_string()).collect(), value: value.to_string() }
    }

    fn keys(found: Vec<(String, Arc<str>)>) -> Vec<String> {
        found.into_iter().map(|(key, _)| key).collect()
    }

    #[test]
    fn a_find_keeps_the_documents_that_hold_every_condition() {
        let store = flights();
        let mut txn = Txn::new(store.snapshot(), WriteQuota::default());
        let mut find = |prefix, conditions: &[FieldIs]| keys(txn.try_find("flights", prefix, conditions).unwrap());
        assert_eq!(find("A", &[is(&["origin"], r#""SFO""#)]), ["A1", "A3"], "nested and quoted lookalikes");
        assert_eq!(find("", &[is(&["seats"], "3")]), ["A1", "A2", "B1"], "3.0 is 3");
        assert_eq!(find("", &[is(&["origin"], r#""SFO""#), is(&["seats"], "3.0")]), ["A1", "B1"]);
        assert_eq!(find("", &[is(&["extra"], r#"{ "a": [1, 2], "b": 1.0 }"#)]), ["A3"], "compared canonically");
        assert_eq!(find("", &[is(&["dates", "d1", "origin"], r#""JFK""#)]), ["A1"]);
        assert_eq!(find("", &[is(&["origin", "x"], r#""SFO""#)]), Vec::<String>::new());
        assert_eq!(find("", &[]).len(), 4);
        let quoted = MemoryStore::new(State::from_json(&json!({ "n": { "k": { "q\"uote\\": 1 } } })).unwrap());
        let mut quoted = Txn::new(quoted.snapshot(), WriteQuota::default());
        assert_eq!(keys(quoted.try_find("n", "", &[is(&["q\"uote\\"], "1")]).unwrap()), ["k"], "an escaped key");
        assert!(matches!(
            txn.try_find("flights", "", &[is(&["origin"], "SFO")]),
            Err(TxnError::InvalidCondition { namespace, path, .. }) if namespace == "flights" && path == "origin"
        ));
    }

    #[test]
    fn a_find_sees_the_calls_own_writes_and_deletes() {
        let store = flights();
        let mut txn = Txn::new(store.snapshot(), WriteQuota::default());
        txn.put("flights", "A2", r#"{"origin":"SFO"}"#).unwrap();
        txn.put("flights", "C1", r#"{"origin":"SFO"}"#).unwrap();
        txn.delete("flights", "A1").unwrap();
        let found = keys(txn.try_find("flights", "", &[is(&["origin"], r#""SFO""#)]).unwrap());
        assert_eq!(found, ["A2", "A3", "B1", "C1"]);
    }

    /// A find reads its whole range: a change to a document it left out conflicts too (the
    /// change could have made it match), as does a key added to the range; a change outside
    /// the range does not.
    #[test]
    fn a_find_conflicts_with_a_change_anywhere_in_its_range_and_nowhere_else() {
        let store = flights();
        let finder = || {
            let mut txn = Txn::new(store.snapshot(), WriteQuota::default());
            txn.try_find("flights", "A", &[is(&["origin"], r#""SFO""#)]).unwrap();
            txn.put("flights", "count", "1").unwrap();
            txn
        };
        let commit = |key: &str, doc: &str| {
            let mut txn = Txn::new(store.snapshot(), WriteQuota::default());
            txn.put("flights", key, doc).unwrap();
            store.commit(&txn).unwrap();
        };
        let (outside, not_matching, added) = (finder(), finder(), finder());
        commit("B1", r#"{"origin":"LAX"}"#);
        store.commit(&outside).unwrap();
        commit("A2", r#"{"origin":"SFO"}"#);
        assert_eq!(store.commit(&not_matching).unwrap_err().key, "A2");
        let late = finder();
        commit("A0", r#"{"origin":"LAX"}"#);
        assert_eq!(store.commit(&late).unwrap_err().key, "A0");
        assert_eq!(store.commit(&added).unwrap_err().key, "A0");
    }

    #[test]
    fn a_find_looks_at_no_more_documents_than_a_listing_returns() {
        let store = flights();
        let listing = StoreCaps { listed_keys: 3, ..StoreCaps::default() };
        let mut capped = Txn::new(store.snapshot(), WriteQuota::default()).with_caps(listing);
        let e = capped.try_find("flights", "", &[]).unwrap_err();
        assert!(matches!(e, TxnError::CapExceeded { cap: "list size", .. }), "{e}");
        assert_eq!(keys(capped.try_find("flights", "A", &[]).unwrap()), ["A1", "A2", "A3"]);
        let mut long = Txn::new(store.snapshot(), WriteQuota::default());
        let e = long.try_find("flights", "", &[is(&[&"x".repeat(2000)], "1")]).unwrap_err();
        assert!(matches!(e, TxnError::CapExceeded { cap: "key length", .. }), "{e}");
        let many = vec![is(&["seats"], "3"); StoreCaps::default().find_conditions + 1];
        let e = long.try_find("flights", "", &many).unwrap_err();
        assert!(matches!(e, TxnError::CapExceeded { cap: "find conditions", .. }), "{e}");
        let allowed = &many[..StoreCaps::default().find_conditions];
        assert_eq!(keys(long.try_find("flights", "", allowed).unwrap()), ["A1", "A2", "B1"]);
    }

    /// A find's answer is kept with the namespace it read (see `found`): a commit that
    /// writes the namespace, the call's own writes, or other caps must not be answered
    /// from it.
    #[test]
    fn a_kept_find_answers_only_for_the_documents_it_read() {
        let store = flights();
        let sfo = [is(&["origin"], r#""SFO""#)];
        let find = |state: &State, caps: StoreCaps| {
            Txn::new(state.clone(), WriteQuota::default()).with_caps(caps).try_find("flights", "", &sfo).map(keys)
        };
        let question = Question { prefix: String::new(), conditions: sfo.to_vec() };
        let kept = |state: &State| state.namespace("flights").and_then(|n| n.finds.get(&question));
        let before = store.snapshot();
        // A find cut short by a small cap is not kept for a call that may read more.
        let two = StoreCaps { listed_keys: 2, ..StoreCaps::default() };
        assert!(matches!(find(&before, two), Err(TxnError::CapExceeded { cap: "list size", .. })));
        assert!(kept(&before).is_none(), "a cut answer was kept");
        assert_eq!(find(&before, StoreCaps::default()).unwrap(), ["A1", "A3", "B1"]);
        // Kept with the namespace, for every copy that shares it (a case's state, a snapshot).
        assert_eq!(kept(&store.snapshot()).map(|a| a.found.len()), Some(3));
        // A kept answer over more documents than a call's cap still refuses that call.
        assert!(matches!(find(&before, two), Err(TxnError::CapExceeded { cap: "list size", .. })));
        let mut txn = Txn::new(store.snapshot(), WriteQuota::default());
        txn.put("flights", "A2", r#"{"origin":"SFO"}"#).unwrap();
        store.commit(&txn).unwrap();
        assert!(kept(&store.snapshot()).is_none(), "the commit that wrote the namespace forgets it");
        assert_eq!(find(&store.snapshot(), StoreCaps::default()).unwrap(), ["A1", "A2", "A3", "B1"]);
        assert_eq!(find(&before, StoreCaps::default()).unwrap(), ["A1", "A3", "B1"], "the older copy is unchanged");
        let mut own = Txn::new(before.clone(), WriteQuota::default());
        own.delete("flights", "B1").unwrap();
        assert_eq!(keys(own.try_find("flights", "", &sfo).unwrap()), ["A1", "A3"]);
    }

    #[test]
    fn unchanged_rewrites_are_not_changes() {
        let store = store();
        let mut txn = Txn::new(store.snapshot(), WriteQuota::default());
        txn.put("pools", "p", r#"{"allocated":0.0}"#).unwrap();
        assert!(store.commit(&txn).unwrap().is_empty());
    }
}
