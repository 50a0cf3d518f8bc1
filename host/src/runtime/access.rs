//! A call's access to the store, through its plugin's grants: the one check and the one
//! error mapping that the sandbox and the native build of the tools share.

use std::sync::Arc;

use sagabox_toolkit::StoreErrorKind;

use super::policy::StoreGrants;
use crate::store::{FieldIs, Txn, TxnError};

/// Why a store operation did not happen.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// The policy does not grant the namespace: the call is stopped with `access_denied`.
    Denied(String),
    /// The store refused it: the tool is told, and may handle it.
    Store(StoreErrorKind, String),
}

impl From<TxnError> for Refusal {
    fn from(e: TxnError) -> Refusal {
        let kind = match e {
            TxnError::InvalidDocument { .. } | TxnError::InvalidCondition { .. } => StoreErrorKind::InvalidDocument,
            // A cap is a quota on what the host holds for the call; the message names it.
            TxnError::QuotaExceeded(_) | TxnError::CapExceeded { .. } => StoreErrorKind::QuotaExceeded,
        };
        Refusal::Store(kind, e.to_string())
    }
}

/// A call's transaction seen through its plugin's store grants.
pub(crate) struct Granted<'a> {
    pub txn: &'a mut Txn,
    pub grants: &'a StoreGrants,
}

impl Granted<'_> {
    fn readable(&self, ns: &str) -> Result<(), Refusal> {
        if self.grants.can_read(ns) {
            return Ok(());
        }
        Err(Refusal::Denied(format!("namespace '{ns}' is not granted for reading")))
    }

    fn writable(&self, ns: &str) -> Result<(), Refusal> {
        if self.grants.can_write(ns) {
            return Ok(());
        }
        Err(Refusal::Denied(format!("namespace '{ns}' is not granted for writing")))
    }

    pub fn get(&mut self, ns: &str, key: &str) -> Result<Option<Arc<str>>, Refusal> {
        self.readable(ns)?;
        Ok(self.txn.try_get(ns, key)?)
    }

    /// Checks a write's grant before the caller fires anything armed at writes.
    pub fn check_write(&self, ns: &str) -> Result<(), Refusal> {
        self.writable(ns)
    }

    pub fn put(&mut self, ns: &str, key: &str, doc: &str) -> Result<(), Refusal> {
        self.writable(ns)?;
        Ok(self.txn.put(ns, key, doc)?)
    }

    pub fn delete(&mut self, ns: &str, key: &str) -> Result<bool, Refusal> {
        self.writable(ns)?;
        Ok(self.txn.delete(ns, key)?)
    }

    pub fn list(&mut self, ns: &str, prefix: &str) -> Result<Vec<String>, Refusal> {
        self.readable(ns)?;
        Ok(self.txn.try_list(ns, prefix)?)
    }

    pub fn find(&mut self, ns: &str, prefix: &str, conditions: &[FieldIs]) -> Result<Vec<(String, Arc<str>)>, Refusal> {
        self.readable(ns)?;
        Ok(self.txn.try_find(ns, prefix, conditions)?)
    }
}
