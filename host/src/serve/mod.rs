//! `sagabox serve`: plugin tools and sagas over the Model Context Protocol (on `rmcp`, the
//! official Rust SDK), where an agent's session is a saga.
//!
//! - [`catalog`]: the served tools, their names and schemas;
//! - [`handler`]: one connection, routing calls to transactions;
//! - [`transaction`]: an agent's open saga, one task each;
//! - [`sagas`]: `saga_<name>` tools, each running a whole saga;
//! - [`stdio`]: line framing in front of rmcp, answering what it would drop;
//! - [`http`]: the Streamable HTTP transport;
//! - [`logging`]: plugin log messages as MCP logging notifications.

pub mod catalog;
pub mod handler;
pub mod http;
pub mod logging;
pub mod sagas;
pub mod stdio;
pub mod transaction;

use std::sync::Arc;

use rmcp::ServiceExt;
use rmcp::model::ListToolsResult;

use crate::saga::Saga;
pub use handler::{Connection, Transport};
pub use transaction::{Context, OnDisconnect, OnFailure, Transactions};

/// What a server serves and how it treats transactions.
pub struct Server {
    pub transactions: Arc<Transactions>,
    pub catalog: catalog::Catalog,
    /// `tools/list`'s answer, built once.
    pub tool_list: ListToolsResult,
    pub on_disconnect: OnDisconnect,
}

/// Why the server could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("tool '{tool}' cannot be described to MCP clients: {reason}")]
    Tool { tool: String, reason: String },
    #[error("MCP over stdio: {0}")]
    Stdio(String),
    #[error("MCP over HTTP on {addr}: {reason}")]
    Http { addr: String, reason: String },
}

impl Server {
    pub fn new(
        context: Context,
        sagas: &[Arc<Saga>],
        expose_compensators: bool,
        on_disconnect: OnDisconnect,
    ) -> Result<Arc<Server>, ServeError> {
        let catalog = catalog::Catalog::new(&context.runtime, sagas, expose_compensators);
        let tools = catalog
            .tools
            .iter()
            .map(|t| {
                serde_json::from_value::<rmcp::model::Tool>(t.clone()).map_err(|e| ServeError::Tool {
                    tool: t["name"].as_str().unwrap_or("?").to_string(),
                    reason: e.to_string(),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let tool_list = ListToolsResult::with_all_items(tools);
        Ok(Arc::new(Server { transactions: Transactions::new(Arc::new(context)), catalog, tool_list, on_disconnect }))
    }

    /// Serves one client on stdin/stdout until it closes them; then ends the transactions
    /// it left open (compensating them, unless `--on-disconnect keep`).
    pub async fn serve_stdio(self: &Arc<Self>) -> Result<(), ServeError> {
        let connection = Connection::new(Arc::clone(self), Transport::Stdio);
        // Non-blocking pipes when the client made them (as MCP clients do): no hand-off to a
        // blocking thread per message.
        let (input, output) = rmcp::transport::io::stdio_pipes();
        let pipes = stdio::framed(input, output);
        let running = connection.clone().serve(pipes).await.map_err(|e| ServeError::Stdio(e.to_string()))?;
        let quit = running.waiting().await;
        connection.close().await;
        quit.map(drop).map_err(|e| ServeError::Stdio(e.to_string()))
    }
}
