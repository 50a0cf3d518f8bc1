//! Plugin log messages as MCP logging notifications.
//!
//! MCP logging is deprecated by SEP-2577 (revision 2026-07-28) but clients still use it: a
//! 2025 client sets its level with `logging/setLevel`, a 2026-07-28 one per request in
//! `_meta`. Without a level, nothing is sent. Hence the `allow(deprecated)`.
#![allow(deprecated)]

use std::sync::Arc;
use std::time::Duration;

use rmcp::model::{LoggingLevel, LoggingMessageNotificationParam};
use rmcp::service::{Peer, RequestContext, RoleServer};
use serde_json::json;

use crate::runtime::{LogLevel, LogSink};

/// A level as a number: higher is more severe.
pub type Rank = u8;

pub fn rank(level: LoggingLevel) -> Rank {
    match level {
        LoggingLevel::Debug => 0,
        LoggingLevel::Info => 1,
        LoggingLevel::Notice => 2,
        LoggingLevel::Warning => 3,
        LoggingLevel::Error => 4,
        LoggingLevel::Critical => 5,
        LoggingLevel::Alert => 6,
        LoggingLevel::Emergency => 7,
    }
}

fn protocol_level(level: LogLevel) -> LoggingLevel {
    match level {
        LogLevel::Trace | LogLevel::Debug => LoggingLevel::Debug,
        LogLevel::Info => LoggingLevel::Info,
        LogLevel::Warn => LoggingLevel::Warning,
        LogLevel::Error => LoggingLevel::Error,
    }
}

/// Sends a request's plugin logs to its client, from `min` up.
struct ClientLog {
    peer: Peer<RoleServer>,
    min: Rank,
}

impl LogSink for ClientLog {
    fn log(&self, level: LogLevel, tool: &str, message: &str) {
        let level = protocol_level(level);
        if rank(level) < self.min {
            return;
        }
        let param = LoggingMessageNotificationParam::new(level, json!({ "tool": tool, "message": message }))
            .with_logger(tool.to_string());
        let peer = self.peer.clone();
        // A client that stops reading must not hold up the call: the message is dropped.
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(1), peer.notify_logging_message(param)).await;
        });
    }
}

/// The sink for a request's plugin logs: its `_meta` level, else the connection's
/// `logging/setLevel` one, else none.
pub fn sink_for(context: &RequestContext<RoleServer>, connection_level: Option<Rank>) -> Option<Arc<dyn LogSink>> {
    let min = context.meta.log_level().map(rank).or(connection_level)?;
    Some(Arc::new(ClientLog { peer: context.peer.clone(), min }))
}
