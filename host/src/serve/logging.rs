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
use tokio::sync::mpsc;

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

/// Queues a request's plugin logs, from `min` up, for its client.
struct ClientLog {
    min: Rank,
    queue: mpsc::UnboundedSender<LoggingMessageNotificationParam>,
}

impl LogSink for ClientLog {
    fn log(&self, level: LogLevel, tool: &str, message: &str) {
        let level = protocol_level(level);
        if rank(level) < self.min {
            return;
        }
        let param = LoggingMessageNotificationParam::new(level, json!({ "tool": tool, "message": message }))
            .with_logger(tool.to_string());
        let _ = self.queue.send(param);
    }
}

/// A request's log sink and the task that sends what it queues, in order.
pub struct ClientLogs {
    pub sink: Arc<dyn LogSink>,
    sending: tokio::task::JoinHandle<()>,
}

impl ClientLogs {
    /// Waits until the messages queued so far are sent (the call is over, so its sink's
    /// last user is gone), for at most two seconds: a client that stops reading loses
    /// them, and never holds up the answer for long.
    pub async fn flushed(self) {
        drop(self.sink);
        let _ = tokio::time::timeout(Duration::from_secs(2), self.sending).await;
    }
}

/// The sink for a request's plugin logs: its `_meta` level, else the connection's
/// `logging/setLevel` one, else none.
pub fn for_request(context: &RequestContext<RoleServer>, connection_level: Option<Rank>) -> Option<ClientLogs> {
    let min = context.meta.log_level().map(rank).or(connection_level)?;
    let (queue, mut queued) = mpsc::unbounded_channel();
    let peer: Peer<RoleServer> = context.peer.clone();
    let sending = tokio::spawn(async move {
        while let Some(param) = queued.recv().await {
            let _ = tokio::time::timeout(Duration::from_secs(1), peer.notify_logging_message(param)).await;
        }
    });
    Some(ClientLogs { sink: Arc::new(ClientLog { min, queue }), sending })
}
