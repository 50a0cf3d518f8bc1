//! One MCP connection: answers `tools/list` and `tools/call`, routing each call to its
//! transaction.
//!
//! Which transaction a call belongs to: the `transaction` argument, else
//! `_meta["io.sagabox/transaction"]`, else the connection's own (opened at its first call)
//! where there is a connection: stdio, or an HTTP session of a protocol revision that has
//! sessions. A stateless request (revision 2026-07-28 over HTTP) without a handle is a
//! transaction of its own, committed when it succeeds.

use crate::sync::lock;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ErrorData as McpError, Implementation, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig,
};
use rmcp::service::{RequestContext, RoleServer};
use serde_json::{Map, Value, json};

use super::Server;
use super::catalog::{Control, Entry, TRANSACTION_ARG, served_name};
use super::logging;
use super::transaction::{CallReply, CallRequest, Ending, OnDisconnect, Transaction, ending_reason};
use crate::saga::definition::DurationSpec;
use crate::saga::journal::ErrorInfo;

/// `_meta` keys a client may set on a call.
const META_TRANSACTION: &str = "io.sagabox/transaction";
const META_KEY: &str = "idempotency_key";
const META_KEY_NAMESPACED: &str = "io.sagabox/idempotency_key";

/// How a connection reaches the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Stdio,
    Http,
}

/// One client connection (or, over stateless HTTP, one request). Clones share it; when the
/// last one goes (rmcp drops an ended HTTP session's handler), its open transactions are
/// ended as abandoned.
#[derive(Clone)]
pub struct Connection(Arc<ConnectionState>);

impl std::ops::Deref for Connection {
    type Target = ConnectionState;
    fn deref(&self) -> &ConnectionState {
        &self.0
    }
}

pub struct ConnectionState {
    server: Arc<Server>,
    transport: Transport,
    /// The connection's transaction, used by calls that name none.
    current: Mutex<Option<Transaction>>,
    /// Transactions begun on this connection: they end with it.
    owned: Mutex<Vec<Transaction>>,
    /// The least severe plugin log level the client asked for (`logging/setLevel`).
    log_level: Mutex<Option<logging::Rank>>,
}

impl Connection {
    pub fn new(server: Arc<Server>, transport: Transport) -> Connection {
        Connection(Arc::new(ConnectionState {
            server,
            transport,
            current: Mutex::new(None),
            owned: Mutex::new(Vec::new()),
            log_level: Mutex::new(None),
        }))
    }

    /// Ends the transactions begun on this connection that are still open, as
    /// `--on-disconnect` says: the client is gone.
    pub async fn close(&self) {
        let open = self.take_open();
        end_abandoned(&self.server, open).await;
    }
}

impl ConnectionState {
    fn take_open(&self) -> Vec<Transaction> {
        let mut open: Vec<Transaction> = std::mem::take(&mut *lock(&self.owned));
        open.extend(lock(&self.current).take());
        open.retain(Transaction::is_open);
        open.dedup_by(|a, b| a.id == b.id);
        open
    }
}

impl Connection {
    /// Whether this request belongs to a connection that outlives it.
    fn has_connection(&self, context: &RequestContext<RoleServer>) -> bool {
        // A 2026-07-28 request carries its version in `_meta`; that revision has no sessions.
        let modern = context.meta.protocol_version().is_some_and(|v| !v.has_initialize());
        self.transport == Transport::Stdio || !modern
    }

    async fn call(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, McpError> {
        let name = request.name.to_string();
        let mut args = request.arguments.unwrap_or_default();
        let meta = merged_meta(request.meta.as_ref().map(|m| &m.0.0), &context.meta.0.0);
        let Some(entry) = self.server.catalog.entry(&name).cloned() else {
            let served = self.server.catalog.names().join(", ");
            return Err(McpError::invalid_params(format!("unknown tool '{name}'; served tools: {served}"), None));
        };
        Ok(match entry {
            Entry::Control(control) => self.control(control, &args, &meta, &context).await,
            Entry::Saga(saga) => super::sagas::run(&self.server, &saga, Value::Object(args), &context).await,
            Entry::Plugin { qualified, takes_handle, .. } => {
                let named = if takes_handle { args.remove(TRANSACTION_ARG) } else { None };
                let handle = handle_of(named.as_ref(), &meta);
                let key = meta.get(META_KEY).or_else(|| meta.get(META_KEY_NAMESPACED)).and_then(as_key);
                self.plugin_call(&qualified, Value::Object(args), handle, key, context).await
            }
        })
    }

    async fn plugin_call(
        &self,
        tool: &str,
        args: Value,
        handle: Option<String>,
        key: Option<String>,
        context: RequestContext<RoleServer>,
    ) -> CallToolResult {
        let (transaction, single) = match handle {
            Some(id) => match self.server.transactions.get(&id) {
                Some(t) => (t, false),
                None => return closed_result(&id),
            },
            None if self.has_connection(&context) => match self.connection_transaction() {
                Ok(t) => (t, false),
                Err(result) => return result,
            },
            None => match self.server.transactions.begin(None, None) {
                Ok(t) => (t, true),
                Err(e) => {
                    return error_result(
                        &e.to_string(),
                        json!({ "error": { "code": "host", "message": e.to_string() } }),
                    );
                }
            },
        };
        let logs = logging::for_request(&context, *lock(&self.log_level));
        let request = CallRequest {
            tool: tool.to_string(),
            args,
            client_key: key,
            cancel: context.ct.clone(),
            log: logs.as_ref().map(|l| Arc::clone(&l.sink)),
        };
        let reply = transaction.call(request).await;
        if let Some(logs) = logs {
            // The call's log notifications go out before its answer.
            logs.flushed().await;
        }
        if single {
            // A request of its own: kept when it succeeded, undone (nothing) when not.
            let succeeded = matches!(reply, Ok(CallReply::Completed { .. }));
            let _ = transaction.end(succeeded, None).await;
        }
        match reply {
            Ok(reply) => call_result(reply),
            Err(closed) => closed_result(&closed.0),
        }
    }

    /// The connection's open transaction, begun now if it has none.
    fn connection_transaction(&self) -> Result<Transaction, CallToolResult> {
        let mut current = lock(&self.current);
        if let Some(t) = current.as_ref().filter(|t| t.is_open()) {
            return Ok(t.clone());
        }
        let t = self.server.transactions.begin(None, None).map_err(|e| {
            error_result(&e.to_string(), json!({ "error": { "code": "host", "message": e.to_string() } }))
        })?;
        *current = Some(t.clone());
        Ok(t)
    }

    async fn control(
        &self,
        control: Control,
        args: &Map<String, Value>,
        meta: &Map<String, Value>,
        context: &RequestContext<RoleServer>,
    ) -> CallToolResult {
        if control == Control::Begin {
            return self.begin(args, context);
        }
        let named = handle_of(args.get(TRANSACTION_ARG), meta);
        let transaction = match &named {
            Some(id) => self.server.transactions.get(id),
            None => lock(&self.current).clone().filter(Transaction::is_open),
        };
        let Some(transaction) = transaction else {
            return match named {
                Some(id) => closed_result(&id),
                None => error_result(
                    "no open transaction: name one with `transaction`, or make a call first",
                    json!({ "error": { "code": "no_transaction", "message": "no open transaction" } }),
                ),
            };
        };
        let answer = match control {
            Control::Status => transaction.status().await.map(|s| serde_json::to_value(s).unwrap_or_default()),
            Control::Commit => transaction.end(true, None).await.map(|e| ending_value(&e)),
            Control::Abort | Control::Begin => {
                let reason = args.get("reason").and_then(Value::as_str).unwrap_or("aborted by the client");
                transaction.end(false, Some(ending_reason("aborted", reason))).await.map(|e| ending_value(&e))
            }
        };
        match answer {
            Ok(value) => ok_result(value, Map::new()),
            Err(closed) => closed_result(&closed.0),
        }
    }

    fn begin(&self, args: &Map<String, Value>, context: &RequestContext<RoleServer>) -> CallToolResult {
        let name = args.get("name").and_then(Value::as_str);
        let timeout = match args.get("timeout").map(|v| serde_json::from_value::<DurationSpec>(v.clone())) {
            None => None,
            Some(Ok(spec)) => Some(spec.0),
            Some(Err(e)) => {
                return error_result(
                    &format!("saga_begin: timeout: {e}"),
                    json!({ "error": { "code": "invalid_input", "message": e.to_string() } }),
                );
            }
        };
        if let Some(limit) = timeout.filter(|t| *t > Duration::from_secs(24 * 3600)) {
            let message = format!("saga_begin: a timeout of {} s is over the 24 h limit", limit.as_secs());
            return error_result(&message, json!({ "error": { "code": "invalid_input", "message": message } }));
        }
        let connection = self.has_connection(context);
        if connection && let Some(open) = lock(&self.current).as_ref().filter(|t| t.is_open()) {
            let message =
                format!("transaction '{}' is still open on this connection: commit or abort it first", open.id);
            return error_result(&message, json!({ "error": { "code": "transaction_open", "message": message } }));
        }
        let transaction = match self.server.transactions.begin(name, timeout) {
            Ok(t) => t,
            Err(e) => {
                return error_result(&e.to_string(), json!({ "error": { "code": "host", "message": e.to_string() } }));
            }
        };
        if connection {
            *lock(&self.current) = Some(transaction.clone());
            lock(&self.owned).push(transaction.clone());
        }
        ok_result(
            json!({
                "transaction": transaction.id,
                "name": transaction.name,
                "timeout_ms": timeout.map(|t| t.as_millis() as u64),
            }),
            Map::new(),
        )
    }
}

impl Drop for ConnectionState {
    fn drop(&mut self) {
        // An HTTP session that ended (deleted or expired): its open transactions are the
        // abandoned ones. (stdio closes explicitly, before the process exits.)
        let open = self.take_open();
        if open.is_empty() {
            return;
        }
        let server = Arc::clone(&self.server);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { end_abandoned(&server, open).await });
        }
    }
}

/// Ends transactions whose client went away, as `--on-disconnect` says.
async fn end_abandoned(server: &Server, open: Vec<Transaction>) {
    let keep = server.on_disconnect == OnDisconnect::Keep;
    for transaction in open {
        let reason = (!keep).then(|| ending_reason("disconnected", "the client disconnected"));
        if let Ok(ending) = transaction.end(keep, reason).await {
            tracing::info!(transaction = %ending.transaction, status = ending.status, "client gone; transaction ended");
        }
    }
}

impl rmcp::ServerHandler for Connection {
    // Logging is deprecated by SEP-2577, still used by 2025 clients (see `logging`).
    #[allow(deprecated)]
    fn get_info(&self) -> ServerConfig {
        let capabilities = ServerCapabilities::builder().enable_tools().enable_logging().build();
        ServerConfig::new(capabilities)
            .with_server_info(Implementation::new("sagabox", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Sandboxed tools whose calls form a transaction (a saga): every effect is recorded with its \
                 compensator and undone if a call fails, on saga_abort, or if the client goes away. Use \
                 saga_begin/saga_commit/saga_abort/saga_status to control it.",
            )
    }

    #[allow(deprecated)]
    async fn set_level(
        &self,
        request: rmcp::model::SetLevelRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<(), McpError> {
        *lock(&self.log_level) = Some(logging::rank(request.level));
        Ok(())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        Ok(self.server.tool_list.clone())
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        // A panic must not leave the client waiting for an answer that never comes.
        let name = request.name.to_string();
        match AssertUnwindSafe(self.call(request, context)).catch_unwind().await {
            Ok(result) => result.map(CallToolResponse::Complete),
            Err(_) => {
                tracing::error!(tool = %name, "the call's handler panicked");
                Err(McpError::internal_error(format!("{name}: internal error in the server"), None))
            }
        }
    }
}

/// The request's `_meta`, from the params and the context (the transport may hold either).
fn merged_meta(params: Option<&Map<String, Value>>, context: &Map<String, Value>) -> Map<String, Value> {
    let mut meta = context.clone();
    if let Some(params) = params {
        meta.extend(params.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    meta
}

fn handle_of(named: Option<&Value>, meta: &Map<String, Value>) -> Option<String> {
    named.or_else(|| meta.get(META_TRANSACTION)).and_then(Value::as_str).filter(|s| !s.is_empty()).map(str::to_string)
}

fn as_key(value: &Value) -> Option<String> {
    match value {
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn ending_value(ending: &Ending) -> Value {
    serde_json::to_value(served_names(ending)).unwrap_or_default()
}

/// `ending` with its tools named as the client calls them (`hotel__reserve`).
fn served_names(ending: &Ending) -> Ending {
    let mut ending = ending.clone();
    for undone in &mut ending.compensated {
        undone.tool = served_name(&undone.tool);
        undone.compensator = undone.compensator.as_deref().map(served_name);
    }
    for failure in &mut ending.compensation_failures {
        failure.tool = served_name(&failure.tool);
    }
    ending
}

/// A tool result from JSON, as the protocol writes it.
fn result_from(value: Value) -> CallToolResult {
    let value = match value {
        Value::Object(mut map) => {
            map.insert("resultType".into(), json!("complete"));
            Value::Object(map)
        }
        other => other,
    };
    serde_json::from_value(value).unwrap_or_else(|e| {
        tracing::error!("cannot encode a tool result: {e}");
        let mut result = CallToolResult::default();
        result.is_error = Some(true);
        result
    })
}

/// A successful result: the value as text, and as structured content (an object).
pub(super) fn ok_result(value: Value, meta: Map<String, Value>) -> CallToolResult {
    let text = serde_json::to_string(&value).unwrap_or_default();
    let structured = if value.is_object() { value } else { json!({ "result": value }) };
    let mut result =
        json!({ "content": [{ "type": "text", "text": text }], "structuredContent": structured, "isError": false });
    if !meta.is_empty() {
        result["_meta"] = Value::Object(meta);
    }
    result_from(result)
}

/// A tool error the agent reads: `message` as text, `detail` as structured content.
pub(super) fn error_result(message: &str, detail: Value) -> CallToolResult {
    result_from(
        json!({ "content": [{ "type": "text", "text": message }], "structuredContent": detail, "isError": true }),
    )
}

fn closed_result(id: &str) -> CallToolResult {
    let message = super::transaction::Closed(id.to_string()).to_string();
    error_result(&message, json!({ "error": { "code": "transaction_closed", "message": message }, "transaction": id }))
}

fn call_result(reply: CallReply) -> CallToolResult {
    match reply {
        CallReply::Completed { transaction, step, output, replayed } => {
            let meta = Map::from_iter([
                (META_TRANSACTION.to_string(), json!(transaction)),
                ("io.sagabox/step".to_string(), json!(step)),
                ("io.sagabox/replayed".to_string(), json!(replayed)),
            ]);
            ok_result(output, meta)
        }
        CallReply::Failed { transaction, step, error, ending } => failed_result(&transaction, step, &error, ending),
    }
}

/// A failed call: what failed, and where the world stands (what was compensated).
fn failed_result(transaction: &str, step: Option<String>, error: &ErrorInfo, ending: Option<Ending>) -> CallToolResult {
    let mut message = error.message.clone();
    let mut detail = json!({ "error": error, "transaction": transaction, "step": step, "status": "open" });
    if let Some(ending) = ending.as_ref().map(served_names) {
        let undone: Vec<String> = ending.compensated.iter().map(|u| format!("{} ({})", u.tool, u.step)).collect();
        message.push_str(&format!(
            "\ntransaction {transaction} {}: compensated {}",
            ending.status.replace('_', " "),
            if undone.is_empty() { "nothing".to_string() } else { undone.join(", ") }
        ));
        for failure in &ending.compensation_failures {
            message.push_str(&format!("\ncompensation of {} failed: {}", failure.step, failure.error.message));
        }
        detail["status"] = json!(ending.status);
        detail["compensated"] = json!(ending.compensated);
        detail["compensation_failures"] = json!(ending.compensation_failures);
    }
    error_result(&message, detail)
}
