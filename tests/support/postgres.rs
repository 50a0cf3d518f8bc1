//! A PostgreSQL schema of its own for each test, on the server `SAGABOX_PG_URL` names
//! (default: the machine's own, postgres://postgres@127.0.0.1:5432/test). A test that needs
//! PostgreSQL fails, loudly, when the server is unreachable: it never skips.

use std::sync::atomic::{AtomicUsize, Ordering};

/// The server the tests use.
pub fn server_url() -> String {
    std::env::var("SAGABOX_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// A schema that lives as long as the value; its URL makes every connection use it.
pub struct Schema {
    pub name: String,
    pub url: String,
}

impl Schema {
    /// A new, empty schema named after `tag` and this process.
    pub fn new(tag: &str) -> Schema {
        static COUNT: AtomicUsize = AtomicUsize::new(0);
        let n = COUNT.fetch_add(1, Ordering::Relaxed);
        let name = format!(
            "sagabox_t_{}_{}_{n}",
            tag.to_lowercase().replace(|c: char| !c.is_ascii_alphanumeric(), "_"),
            std::process::id()
        );
        execute(&format!("DROP SCHEMA IF EXISTS {name} CASCADE; CREATE SCHEMA {name}"));
        let server = server_url();
        let separator = if server.contains('?') { '&' } else { '?' };
        let url = format!("{server}{separator}options=-csearch_path%3D{name}");
        Schema { name, url }
    }
}

impl Drop for Schema {
    fn drop(&mut self) {
        if let Err(e) = try_execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.name)) {
            eprintln!("cannot drop schema {}: {e}", self.name);
        }
    }
}

/// Runs `sql` on the server, and fails the test, naming the server, if it cannot.
pub fn execute(sql: &str) {
    if let Err(e) = try_execute(sql) {
        panic!("{e}");
    }
}

/// Runs `sql` on the server (on a thread of its own: callers may be inside a runtime).
pub fn try_execute(sql: &str) -> Result<(), String> {
    try_query(sql).map(|_| ())
}

/// The first column, as text, of the rows `sql` returns; fails the test if it cannot.
pub fn query(sql: &str) -> Vec<String> {
    try_query(sql).unwrap_or_else(|e| panic!("{e}"))
}

/// Runs `sql` (one statement or several) on the server, on a thread of its own, and returns
/// the first column of the rows it returns, as text.
pub fn try_query(sql: &str) -> Result<Vec<String>, String> {
    let (url, sql) = (server_url(), sql.to_string());
    let worker = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
        runtime.block_on(async {
            let client = connect(&url).await.map_err(|e| {
                format!(
                    "PostgreSQL is unreachable at {url}: {e}. These tests need a server: start one, or point \
                     SAGABOX_PG_URL at one (README, Testing)"
                )
            })?;
            let messages = client.simple_query(&sql).await.map_err(|e| format!("{sql}: {e}"))?;
            let first = |m: &tokio_postgres::SimpleQueryMessage| match m {
                tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_string),
                _ => None,
            };
            Ok(messages.iter().filter_map(first).collect())
        })
    });
    worker.join().unwrap_or_else(|_| Err("the PostgreSQL helper thread panicked".into()))
}

/// A connection to `url` (its connection task spawned on the caller's runtime), waiting up
/// to a minute while the server has no connection slot free: the tests' sagabox processes
/// take and free many.
pub async fn connect(url: &str) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let started = std::time::Instant::now();
    loop {
        match tokio_postgres::connect(url, tokio_postgres::NoTls).await {
            Ok((client, connection)) => {
                tokio::spawn(connection);
                return Ok(client);
            }
            Err(e)
                if e.code() == Some(&tokio_postgres::error::SqlState::TOO_MANY_CONNECTIONS)
                    && started.elapsed() < std::time::Duration::from_secs(60) =>
            {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e),
        }
    }
}
