//! The bundled tools' logic called natively, outside any sandbox: the baseline the
//! benchmarks measure the sandbox against. Same arguments, same store transaction, same
//! namespace grants; no instance, no fuel, no deadline.

use sagabox_toolkit::{Context, FieldIs, Store, ToolError};
use serde_json::Value;

use super::access::{Granted, Refusal};
use super::error::CallError;
use super::policy::Limits;
use super::{CallContext, Plugin};
use crate::store::Txn;

/// The toolkit's store trait over a call's transaction, with the plugin's grants.
struct NativeStore<'a> {
    granted: Granted<'a>,
    /// The first access the grants refused: the call then fails with `access_denied`, as a
    /// sandboxed call is stopped.
    denied: Option<String>,
}

impl NativeStore<'_> {
    fn refused(&mut self, refusal: Refusal) -> ToolError {
        match refusal {
            Refusal::Denied(what) => {
                self.denied.get_or_insert(what.clone());
                ToolError::Transient(what)
            }
            Refusal::Store(kind, message) => ToolError::from_store(kind, message),
        }
    }
}

impl Store for NativeStore<'_> {
    fn get(&mut self, ns: &str, key: &str) -> Result<Option<String>, ToolError> {
        let got = self.granted.get(ns, key);
        got.map(|t| t.map(|t| t.to_string())).map_err(|r| self.refused(r))
    }

    fn put(&mut self, ns: &str, key: &str, doc: &str) -> Result<(), ToolError> {
        let put = self.granted.put(ns, key, doc);
        put.map_err(|r| self.refused(r))
    }

    fn delete(&mut self, ns: &str, key: &str) -> Result<bool, ToolError> {
        let deleted = self.granted.delete(ns, key);
        deleted.map_err(|r| self.refused(r))
    }

    fn list(&mut self, ns: &str, prefix: &str) -> Result<Vec<String>, ToolError> {
        let listed = self.granted.list(ns, prefix);
        listed.map_err(|r| self.refused(r))
    }

    fn find(&mut self, ns: &str, prefix: &str, conditions: &[FieldIs]) -> Result<Vec<(String, String)>, ToolError> {
        let found = self.granted.find(ns, prefix, conditions);
        let found = found.map_err(|r| self.refused(r))?;
        Ok(found.into_iter().map(|(key, text)| (key, text.to_string())).collect())
    }
}

/// Runs `tool` of `plugin` natively on `txn`.
pub(crate) fn call(
    plugin: &Plugin,
    tool: &str,
    args: &Value,
    context: &CallContext,
    limits: &Limits,
    txn: &mut Txn,
) -> Result<Value, CallError> {
    let qualified = format!("{}.{tool}", plugin.name);
    let native = sagabox_toolkit::native_plugin(&plugin.name).ok_or_else(|| CallError::Host {
        tool: qualified.clone(),
        reason: "the plugin has no native build (only bundled tool plugins do)".into(),
    })?;
    let ctx = Context {
        saga_id: context.saga_id.clone(),
        step_id: context.step_id.clone(),
        attempt: context.attempt,
        idempotency_key: context.idempotency_key.clone(),
    };
    let mut store = NativeStore { granted: Granted { txn, grants: &plugin.grants.store }, denied: None };
    let result = (native.call)(&mut store, tool, args, &ctx);
    if let Some(what) = store.denied {
        return Err(CallError::AccessDenied { tool: qualified, what });
    }
    match result {
        Ok(output) => {
            let size = serde_json::to_string(&output).map_or(0, |t| t.len());
            if size > limits.output_bytes() {
                return Err(CallError::OutputTooLarge { tool: qualified, bytes: size, limit: limits.output_bytes() });
            }
            Ok(output)
        }
        Err(ToolError::InvalidInput(message)) => Err(CallError::InvalidInput { tool: qualified, message }),
        Err(ToolError::Rejected(message)) => Err(CallError::Rejected { tool: qualified, message }),
        Err(ToolError::Transient(message)) => Err(CallError::Transient { tool: qualified, message }),
    }
}
